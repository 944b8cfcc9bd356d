"""One rank of a 2-rank gloo job on the CPU: DCP saves its state to the s3:// URL in argv[1]
through ckptstream's StreamWriter, loads it back through StreamReader into poisoned tensors,
and checks every byte (a failed check exits non-zero). Each rank holds tensors of its own and
one both hold (saved once)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstream.dcp


def state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    shared = torch.Generator().manual_seed(7)
    return {f"rank{rank}.w": torch.randn(300, 1000, generator=g),  # 1.2 MB: several chunks with small buffers
            f"rank{rank}.step": torch.tensor([rank + 10]),
            "both.embedding": torch.randn(64, 32, generator=shared)}


if __name__ == "__main__":
    url = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved = state(rank)
    dcp.save(saved, storage_writer=ckptstream.dcp.StreamWriter(url))
    loaded = {k: torch.full_like(v, -1) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=ckptstream.dcp.StreamReader(url))
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), f"rank {rank}: {k} differs"
    dist.barrier()
    dist.destroy_process_group()
