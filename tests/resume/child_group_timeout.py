"""One rank of a two-process gloo run (tests/test_manager_processes.py); numpy cannot be imported.

    child_group_timeout.py RANK DIR PORT silent|locked

silent  both ranks make a CheckpointManager with timeout=1; rank 0 saves step 1 and reports
        how it ended; rank 1 never saves, and only waits (on the default group's barrier)
        until rank 0 has that answer
locked  another process holds rank 1's lock of DIR: both ranks report how making their
        managers ended
Prints a JSON report.
"""

from __future__ import annotations

import sys

if "numpy" not in sys.modules:  # before torch: a plain install has no numpy
    sys.modules["numpy"] = None  # type: ignore[assignment]

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

import ckptstream


def ended(report: dict[str, Any], error: Exception) -> None:
    report.update(result=type(error).__name__, message=str(error), timeout=isinstance(error, TimeoutError),
                  incomplete=isinstance(error, ckptstream.IncompleteCheckpointError))


def main(rank: int, directory: str, port: int, case: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    report: dict[str, Any] = {}
    if case == "locked":
        try:
            ckptstream.CheckpointManager(directory, timeout=60).close()
            report["result"] = "ok"
        except Exception as e:
            ended(report, e)
    else:
        ckpts = ckptstream.CheckpointManager(directory, timeout=1)
        if rank == 0:
            try:
                ckpts.save({"w": torch.arange(100, dtype=torch.float32)}, 1).result()
                report["result"] = "ok"
            except Exception as e:
                ended(report, e)
            report["steps"] = ckpts.steps()
        dist.barrier()  # rank 1 stays in the group until rank 0 has its answer
        ckpts.close()
    dist.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
