"""One rank of a two-process gloo run whose rank 1 never saves (tests/test_manager_processes.py).

    child_group_timeout.py RANK DIR PORT

Both ranks make a CheckpointManager with timeout=1; rank 0 saves step 1 and reports how it
ended; rank 1 only waits (on the default group's barrier) until rank 0 has that answer. numpy
cannot be imported. Prints a JSON report.
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


def main(rank: int, directory: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    report: dict[str, Any] = {}
    ckpts = ckptstream.CheckpointManager(directory, timeout=1)
    if rank == 0:
        handle = ckpts.save(1, {"w": torch.arange(100, dtype=torch.float32)})
        try:
            handle.result()
            report["result"] = "ok"
        except Exception as e:
            report["result"] = type(e).__name__
            report["message"] = str(e)
            report["timeout"] = isinstance(e, TimeoutError)
            report["incomplete"] = isinstance(e, ckptstream.IncompleteCheckpointError)
        report["steps"] = ckpts.steps()
    dist.barrier()  # rank 1 stays in the group until rank 0 has its answer
    ckpts.close()
    dist.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
