"""The directory of a CheckpointManager: one folder per step, one file per rank, a DONE marker.

    DIR/step-000000001200/state.safetensors                (one process)
    DIR/step-000000001200/rank-00003-of-00008.safetensors  (several: one file per rank)
    DIR/step-000000001200/DONE                             JSON, published last, atomically
    DIR/step-000000001200/FAILED-rank-00003                a rank's save failed (no process group)

A step is complete when its DONE marker exists and names files that all exist with the sizes it
records: DONE is published (temp, fsync, rename, directory fsync) only once every rank's file is
durable, and removed first (and that removal made durable) when a step is deleted. Anything
else in DIR is a leftover of an interrupted save: ignored, and removed later.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

from . import _fileio
from ._publish import TEMP_MARK, atomic_file, fsync_dir

DONE = "DONE"
FORMAT = "ckptstream-manager 1"
_STEP_DIR = re.compile(r"step-(\d+)")
_RANK_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.safetensors")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:012d}")


def file_name(rank: int, world_size: int) -> str:
    return "state.safetensors" if world_size == 1 else f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def failed_name(rank: int) -> str:
    return f"FAILED-rank-{rank:05d}"


def step_dirs(directory: str) -> dict[int, str]:
    """Every step folder in ``directory`` (complete or not), by step."""
    found: dict[int, str] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            m = _STEP_DIR.fullmatch(entry.name)
            if m and entry.is_dir(follow_symlinks=False):
                found[int(m.group(1))] = entry.path
    return found


def read_done(folder: str) -> dict[str, Any] | None:
    """The DONE marker of a step folder when the step is complete (its files all there, with the
    sizes it records), else None."""
    try:
        with open(os.path.join(folder, DONE), encoding="utf-8") as f:
            done: dict[str, Any] = json.load(f)
        files = done["files"]
        if done.get("format") != FORMAT or not isinstance(files, dict) or not isinstance(done["world_size"], int):
            return None
        for name, size in files.items():
            if os.path.getsize(os.path.join(folder, name)) != size:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return done


def complete_steps(directory: str) -> list[int]:
    return sorted(step for step, folder in step_dirs(directory).items() if read_done(folder) is not None)


def write_done(directory: str, step: int, world_size: int) -> None:
    """Publish the DONE marker of ``step`` (every rank's file is durable by now)."""
    folder = step_dir(directory, step)
    fsync_dir(directory)  # the step folder's own entry is durable before the marker inside it
    names = [file_name(r, world_size) for r in range(world_size)]
    done = {"format": FORMAT, "step": step, "world_size": world_size,
            "files": {n: os.path.getsize(os.path.join(folder, n)) for n in names}}
    data = (json.dumps(done, indent=1) + "\n").encode()
    with atomic_file(os.path.join(folder, DONE)) as file:
        _fileio.pwrite_all(file.fd, memoryview(data), 0, file.path)


def remove_step(directory: str, folder: str) -> None:
    """Delete a step folder: its DONE marker first, durably, so that a crash midway leaves an
    incomplete step (ignored), never a complete step with files missing."""
    try:
        os.unlink(os.path.join(folder, DONE))
    except FileNotFoundError:
        pass
    else:
        fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)
    fsync_dir(directory)


def remove_own_leftovers(directory: str, rank: int, world_size: int) -> None:
    """Remove this rank's files (and temps, and failure markers) from incomplete step folders:
    a later save of one of those steps must not find them there."""
    mine = (file_name(rank, world_size), failed_name(rank))
    for folder in step_dirs(directory).values():
        if read_done(folder) is not None:
            continue
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(folder):
                if entry.name in mine or any(entry.name.startswith(f".{m}{TEMP_MARK}") for m in mine[:1]):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)


def world_of(name: str) -> int | None:
    m = _RANK_FILE.fullmatch(name)
    return int(m.group(2)) if m else None
