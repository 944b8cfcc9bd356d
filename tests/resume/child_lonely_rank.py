"""One rank of two agreeing through files, whose other rank never saves
(tests/test_manager_processes.py).

    child_lonely_rank.py DIR RANK

Saves step 1 with timeout=1 and reports how the save ended, as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import ckptstream


def main(directory: str, rank: int) -> None:
    report: dict[str, Any] = {}
    with ckptstream.CheckpointManager(directory, rank=rank, world_size=2, timeout=1) as ckpts:
        handle = ckpts.save({"w": torch.arange(100, dtype=torch.float32)}, 1)
        try:
            handle.result()
            report["result"] = "ok"
        except Exception as e:
            report.update(result=type(e).__name__, message=str(e), timeout=isinstance(e, TimeoutError),
                          incomplete=isinstance(e, ckptstream.IncompleteCheckpointError))
        report["steps"] = ckpts.steps()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
