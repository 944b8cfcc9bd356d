"""One rank of a 2-rank gloo job on the CPU: DCP saves its state into the mem:// folder in
argv[1] (the in-memory storage shared by the test process, tests/dcp/sharedmem.py) through
StreamWriter, loads it back through StreamReader into poisoned tensors, and checks every byte
(a failed check exits non-zero). argv[2..4]: the host, port and hex key of the shared dicts."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstream.dcp
from ckptstream._storage import register
from tests.dcp.sharedmem import connect
from tests.s3.child_dcp_rank import state

if __name__ == "__main__":
    url, host, port, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), bytes.fromhex(sys.argv[4])
    store = connect(host, port, key)
    register("mem", lambda: store)
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
