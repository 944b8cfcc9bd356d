"""A CheckpointManager writing an s3:// prefix beside another (tests/s3/test_s3_writers.py).

    child_s3_writer.py URL

Saves step 1 (a state seeded by the step), prints "saved", waits for a line on stdin, then
tries to save step 3 and prints one JSON line: how that ended, the refusal's holder and
message, and the steps the manager lists.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import ckptstream


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(5000, generator=g), "step": step}


if __name__ == "__main__":
    with ckptstream.CheckpointManager(sys.argv[1], keep=None) as ckpts:
        ckpts.save(state(1), 1, blocking=True)
        print("saved", flush=True)
        sys.stdin.readline()
        report: dict[str, Any] = {}
        try:
            ckpts.save(state(3), 3, blocking=True)
            report["result"] = "ok"
        except ckptstream.DirectoryLockedError as e:
            report.update(result=type(e).__name__, holder=e.holder, message=str(e), rank=e.rank)
        report["steps"] = ckpts.steps()
    print(json.dumps(report), flush=True)
