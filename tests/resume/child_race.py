"""One rank of two agreeing through files, with rank 1 slow to see a step complete
(tests/test_manager_processes.py).

    child_race.py RANK DIR SIGNALS KEEP MAX_IN_FLIGHT

Both ranks save steps 1 to MAX_IN_FLIGHT + 1. Rank 1 does not look for step 1's outcome until
rank 0 has gone as far as it can: rank 0 either deleted step 1 (its newer steps complete, step 1
beyond KEEP) or waits for rank 1 at a later step although rank 1's file of that step is there.
Files in SIGNALS carry this order between the processes. Prints a JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ckptstream
from ckptstream._manager import directory as _directory
from ckptstream._manager import ranks

GONE, WAITS, PRUNED = "step-1-deleted", "rank-0-waits-with-rank-1s-file-there", "rank-0-pruned"


def state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(20_000, generator=g), "rank": rank, "step": step}


def signal(signals: Path, name: str) -> None:
    (signals / name).touch()


def rank0_hooks(signals: Path) -> None:
    real_poll, real_remove = ranks.FileRanks._poll, _directory.remove_step

    def poll(self: ranks.FileRanks, step: int, folder: str, publish: Any) -> bool:
        complete = real_poll(self, step, folder, publish)
        if not complete and step > 1 and os.path.exists(os.path.join(folder, _directory.file_name(1, 2))):
            signal(signals, WAITS)
        return complete

    def remove(directory: str, folder: str) -> Any:
        result = real_remove(directory, folder)
        if folder.endswith("step-000000000001"):
            signal(signals, GONE)
        return result

    ranks.FileRanks._poll = poll  # type: ignore[method-assign]
    _directory.remove_step = remove


def rank1_hooks(signals: Path) -> None:
    real_poll = ranks.FileRanks._poll

    def poll(self: ranks.FileRanks, step: int, folder: str, publish: Any) -> bool:
        if step == 1:  # wait for a file: the order is what is tested, not a duration
            while not ((signals / GONE).exists() or (signals / WAITS).exists()):
                time.sleep(0.005)
        return real_poll(self, step, folder, publish)

    ranks.FileRanks._poll = poll  # type: ignore[method-assign]


def main(rank: int, directory: str, signals: Path, keep: int, max_in_flight: int) -> None:
    (rank0_hooks if rank == 0 else rank1_hooks)(signals)
    steps = range(1, max_in_flight + 2)
    report: dict[str, Any] = {}
    with ckptstream.CheckpointManager(directory, rank=rank, world_size=2, keep=keep, max_in_flight=max_in_flight,
                                      timeout=20) as ckpts:
        handles = {}
        for step in steps:
            try:  # an earlier save that failed unseen is raised here
                handles[step] = ckpts.save(state(rank, step), step)
            except Exception as e:
                report[str(step)] = f"{type(e).__name__}: {e}"
        for step, handle in handles.items():
            try:
                handle.result()
                report[str(step)] = "ok"
            except Exception as e:
                report[str(step)] = f"{type(e).__name__}: {e}"
        if rank == 0:  # its last save has pruned: what rank 1 lists from now on is final
            signal(signals, PRUNED)
        else:
            while not (signals / PRUNED).exists():  # a file, not a duration
                time.sleep(0.005)
        report["steps"] = ckpts.steps()
        report["signals"] = sorted(p.name for p in signals.iterdir())
        report["loaded"] = all(torch.equal(ckpts.load(s)["w"], state(rank, s)["w"]) for s in ckpts.steps())
    print(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
