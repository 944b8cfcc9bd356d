"""A CheckpointManager process that tests/test_manager.py kills with SIGKILL mid-save.

    child_kill.py DIR POINT
    Saves step 1 (blocking), prints "ready", then starts the save of step 2 and prints POINT when
    it gets there, then stalls there until killed:
    streaming  the third chunk of step 2's file is being written
    published  step 2's file is durable, its DONE marker not yet written
    pruning    step 2 is complete (DONE durable), step 1 not yet deleted (keep=1)
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine.write import WriteEngine
from ckptstream._manager import directory as _directory
from ckptstream._manager import manager


def state(version: int) -> dict[str, Any]:
    return {"w": torch.arange(1 << 18, dtype=torch.float32) * version, "step": version,
            "optim": {"m": torch.full((1000,), float(version), dtype=torch.bfloat16)}}


def stall(point: str) -> None:
    print(point, flush=True)
    time.sleep(600)


def main(directory: str, point: str) -> None:
    ckpts = ckptstream.CheckpointManager(directory, keep=1, settings=Settings(buffer_size=64 << 10, num_buffers=2,
                                                                              io_threads=1))
    ckpts.save(state(1), 1, blocking=True)
    print("ready", flush=True)
    if point == "streaming":
        real, count = WriteEngine._write, [0]

        def write(self: WriteEngine, chunk: Any, buf: Any) -> None:
            count[0] += 1
            if count[0] == 3:
                stall(point)
            real(self, chunk, buf)

        WriteEngine._write = write  # type: ignore[method-assign]
    elif point == "published":
        _directory.write_done = lambda *args: stall(point)
    elif point == "pruning":
        manager.CheckpointManager._prune = lambda self, newest: stall(point)  # type: ignore[method-assign]
    ckpts.save(state(2), 2)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
