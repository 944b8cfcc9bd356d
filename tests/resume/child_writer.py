"""A CheckpointManager that saves step 1, says "ready" and holds the directory's lock until it
is killed (tests/test_manager_processes.py).

    child_writer.py DIR [RANK WORLD_SIZE]
"""

from __future__ import annotations

import sys
import time

import torch

import ckptstream


def main(directory: str, ranks: list[str]) -> None:
    where = {"rank": int(ranks[0]), "world_size": int(ranks[1])} if ranks else {}
    ckpts = ckptstream.CheckpointManager(directory, **where)  # type: ignore[arg-type]
    if not ranks:
        ckpts.save({"w": torch.arange(1000, dtype=torch.float32), "step": 1}, 1, blocking=True)
    print("ready", flush=True)
    time.sleep(3600)  # until killed


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
