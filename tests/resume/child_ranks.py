"""One rank of a two-process CheckpointManager run (tests/test_manager.py).

    child_ranks.py group|files RANK DIR PORT

Each rank saves its own shard at steps 1, 2 and 3 (keep=2). Rank 1's file of step 2 is late by
a second: rank 0 checks that step 2 is not complete while it waits. Rank 1's save of step 3
fails after its file is in place (the fsync of the step folder after the rename fails): neither
rank may count step 3. Then each rank makes a new manager over the directory (a restart): the
complete steps stay, step 3's folder goes. With "group", the ranks share a gloo process group
and run collectives on it while the saves complete in the background, and numpy cannot be
imported (the manager must not need it). Prints a JSON report.
"""

from __future__ import annotations

import sys

if sys.argv[1] == "group":  # before torch: a plain install has no numpy
    sys.modules["numpy"] = None  # type: ignore[assignment]

import errno
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import ckptstream
from ckptstream._checkpoint import save, save_async
from ckptstream._storage import fileio as _fileio


def shard(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"params": torch.randn(50_000, generator=g), "exp_avg": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "rank": rank, "step": step}


def late_and_failing(rank: int) -> None:
    if rank != 1:
        return
    real_write, real_fsync = save.write_checkpoint, _fileio.fsync
    failed: list[str] = []

    def write(plan: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if "step-000000000002" in path:
            time.sleep(1.0)
        real_write(plan, path, *args, **kwargs)

    def fsync(fd: int, path: str, what: str = "fsync") -> None:
        # the folder's fsync right after this rank's file of step 3 is renamed into it (once)
        if path.endswith("step-000000000003") and "after renaming" in what and not failed:
            failed.append(path)
            raise OSError(errno.EIO, f"Input/output error (injected: {what})", path)
        real_fsync(fd, path, what)

    save_async.write_checkpoint = write  # type: ignore[attr-defined,assignment]
    _fileio.fsync = fsync


def restart(grouped: bool, rank: int, directory: str, report: dict[str, Any]) -> None:
    """A new manager over the directory, once every rank's manager of the run has closed (rank 0
    waits for step 3's outcome): the complete steps stay; the group's rank 0 removes the others."""
    if not grouped:
        open(os.path.join(directory, f".closed-{rank}"), "w").close()
        while not os.path.exists(os.path.join(directory, f".closed-{1 - rank}")):
            time.sleep(0.01)
    where: dict[str, Any] = {} if grouped else {"rank": rank, "world_size": 2}
    with ckptstream.CheckpointManager(directory, keep=2, timeout=60, **where) as again:
        report["restart_steps"] = again.steps()
        if grouped:
            dist.barrier()  # every rank's manager is made: the leftovers are gone
        report["step3_left"] = os.path.exists(os.path.join(directory, "step-000000000003"))


def main(how: str, rank: int, directory: str, port: int) -> None:
    grouped = how == "group"
    if grouped:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    late_and_failing(rank)
    report: dict[str, Any] = {}
    try:
        import numpy  # noqa: F401
        report["numpy"] = True
    except ImportError:
        report["numpy"] = False
    where: dict[str, Any] = {} if grouped else {"rank": rank, "world_size": 2}
    ckpts = ckptstream.CheckpointManager(directory, keep=2, timeout=60, **where)
    for step in (1, 2, 3):
        handle = ckpts.save(shard(rank, step), step)
        if grouped:  # the training's own collectives go on while the save completes
            for _ in range(20):
                t = torch.ones(4)
                dist.all_reduce(t)
                assert t[0].item() == 2
        if rank == 0 and step == 2:
            own, done = handle.path, os.path.join(os.path.dirname(handle.path), "DONE")
            while not os.path.exists(own):
                time.sleep(0.005)
            report["incomplete_while_rank1_writes"] = not os.path.exists(done) and ckpts.latest_step() == 1
        try:
            handle.result()
            report[str(step)] = "ok"
        except Exception as e:
            report[str(step)] = type(e).__name__
            report[f"why-{step}"] = str(e)
    report["steps"], report["latest"] = ckpts.steps(), ckpts.latest_step()
    loaded = ckpts.load(2)
    expected = shard(rank, 2)
    report["loaded"] = all(torch.equal(loaded[k], expected[k]) for k in ("params", "exp_avg")) and \
        (loaded["rank"], loaded["step"]) == (rank, 2)
    report["files"] = sorted(os.listdir(os.path.join(directory, "step-000000000002")))
    ckpts.close()
    restart(grouped, rank, directory, report)
    if grouped:
        dist.barrier()  # no rank tears the group down while another still talks in it
        dist.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
