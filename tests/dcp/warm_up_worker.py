"""One rank of test_bench_warm_up: joins the benchmark's group (``Group.joined``, torchrun's
variables in the environment), then saves a DTensor state through DCP and ``StreamWriter`` as
the benchmark's first timed DCP phase does, and prints, as JSON, the modules of torch's
DTensor and compiler stacks that this first save imported."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed.checkpoint as dcp

import ckptstream.dcp
from ckptstream.bench.multirank import Group

ONCE_PER_PROCESS = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.device_mesh",
                    "torch.distributed._tensor")


def main() -> None:
    directory = sys.argv[1]
    group = Group("cpu")
    with group.joined():
        before = set(sys.modules)
        local = {"w": torch.randn(16, 8, generator=torch.Generator().manual_seed(group.rank))}
        dcp.save(ckptstream.dcp.as_sharded(local), storage_writer=ckptstream.dcp.StreamWriter(directory))
        new = sorted(m for m in set(sys.modules) - before if m.startswith(ONCE_PER_PROCESS))
        group.barrier()
    print(json.dumps({"rank": group.rank, "imported": new}), flush=True)


if __name__ == "__main__":
    main()
