"""One rank of an export test job: ``python hf_worker.py SCENARIO RANK WORLD WORKDIR STORE BACKEND``.

Every rank builds the same tiny GPT-2 (hfutil.tiny_gpt2) and saves its state dict as DTensors
through DCP into WORKDIR/SCENARIO: "shard0" (every tensor sharded on dimension 0, saved by
StreamWriter and by FileSystemWriter), "shard1" (2-d tensors sharded on dimension 1, so that each
rank's chunk holds one run per row), "cuda" (as "shard0", CUDA DTensors, StreamWriter only).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstream.dcp
from tests.hfutil import tiny_gpt2

try:
    from torch.distributed.tensor import Shard, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import Shard, distribute_tensor  # type: ignore[attr-defined]
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    scenario, rank, world, workdir, store, backend = sys.argv[1:7]
    device = torch.device("cuda", int(rank)) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=int(rank), world_size=int(world),
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh(device.type, (int(world),))
    state = {}
    for name, t in tiny_gpt2().state_dict().items():
        dim = 1 if scenario == "shard1" and t.dim() == 2 else 0
        state[name] = distribute_tensor(t.to(device), mesh, [Shard(dim)])
    out = Path(workdir) / scenario
    dcp.save(state, storage_writer=ckptstream.dcp.StreamWriter(out))
    if scenario == "shard0":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(Path(workdir) / "fsw"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
