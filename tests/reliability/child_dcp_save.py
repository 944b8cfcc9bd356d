"""Saves a DCP checkpoint with ckptstream's StreamWriter as one of WORLD ranks (gloo over a file
store): each rank's shard of two tensors as DTensors, and a plain value.

    argv: DIR RANK WORLD STORE
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstream.dcp


def main() -> None:
    directory, rank, world, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        state = ckptstream.dcp.as_sharded({"w": torch.randn(6, 5), "v": torch.randn(4)})
        state["step"] = 7
        dcp.save(state, storage_writer=ckptstream.dcp.StreamWriter(directory))
        dist.barrier()  # no rank tears the group down while another still talks in it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
