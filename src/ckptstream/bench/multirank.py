"""Several processes saving and loading at once (``ckptstream bench --ranks N``).

One process per rank (one GPU each, NCCL; gloo on the CPU), each with its own state of
--size-gib. Every phase starts at a barrier, so all ranks hit the disk together; a phase's time
is the slowest rank's and its aggregate rate is all ranks' bytes over that time.

Before any phase, each rank does once what a training job has done before its first checkpoint
(``Group.warm_up``): the process group's first collectives, and its first DTensor. Their
one-time costs (a communicator that sets itself up on first use; torch importing its compiler
stack on the first ``DTensor.from_local``, which is slow and adds to the RSS) would otherwise
land inside the first timed phase of the DCP systems: with one run per figure, the only one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch

# NVLink SHARP / multicast stays off: the GPU machines of docs/benchmarks.md do not support it
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_envs(world: int) -> list[dict[str, str]]:
    """The environment of each rank's process (torchrun's variables), NCCL settings forced."""
    base = dict(os.environ, **NCCL_ENV)
    if world == 1:
        return [base]
    port = str(_free_port())
    return [dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(world)]


class Group:
    """This process's place among the ranks; every method is a no-op for a single process."""

    def __init__(self, device: str) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = device == "cuda"
        self.device = f"cuda:{self.local_rank}" if self.cuda else "cpu"

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            if self.cuda:
                torch.distributed.barrier(device_ids=[self.local_rank])
            else:
                torch.distributed.barrier()

    def warm_up(self) -> None:
        """Run, untimed, what a training job that checkpoints through DCP has run before: every
        kind of collective DCP's save and load use (object collectives through the device
        with NCCL) and one DTensor made from a local tensor on a mesh over all ranks."""
        group = torch.distributed
        objects: list[Any] = [None] * self.world
        group.all_gather_object(objects, self.rank)
        group.gather_object(self.rank, objects if self.lead else None, dst=0)
        received: list[Any] = [None]
        group.scatter_object_list(received, list(range(self.world)) if self.lead else None, src=0)
        group.broadcast_object_list(received, src=0)
        from torch.distributed.device_mesh import init_device_mesh

        try:
            from torch.distributed.tensor import DTensor, Replicate
        except ImportError:  # torch 2.4
            from torch.distributed._tensor import DTensor, Replicate  # type: ignore[attr-defined]
        mesh = init_device_mesh("cuda" if self.cuda else "cpu", (self.world,))
        DTensor.from_local(torch.zeros(1, device=self.device), mesh, [Replicate()], run_check=False)
        self.barrier()

    @contextlib.contextmanager
    def joined(self) -> Iterator[Group]:
        if self.cuda:
            torch.cuda.set_device(self.device)  # before NCCL init: one GPU per rank
        if self.world == 1:
            yield self
            return
        backend = "nccl" if self.cuda else "gloo"
        kwargs: dict[str, Any] = {"device_id": torch.device(self.device)} if self.cuda else {}
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(minutes=10), **kwargs)
        try:
            self.warm_up()
            yield self
        finally:
            torch.distributed.destroy_process_group()
