"""EFBIG in a real process: saves under RLIMIT_FSIZE with SIGXFSZ ignored, then reports what
happened as one JSON line.

    argv: DIRECTORY DIRECT_IO(auto|off)
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from typing import Any

import torch

import ckptstream
from ckptstream._engine.buffers import POOL
from tests.reliability.relutil import KiB, MiB, assert_same_state, engine_threads, fd_count, small_state, temp_files

LIMIT = 1 * MiB


def error_report(e: OSError) -> dict[str, Any]:
    return {"type": type(e).__name__, "errno": e.errno, "filename": e.filename, "message": str(e)}


def main() -> None:
    directory, direct = sys.argv[1], sys.argv[2]
    path = os.path.join(directory, "ckpt.safetensors")
    old = small_state(1)
    big: dict[str, Any] = {"w": torch.arange(1 << 20, dtype=torch.float32), "step": 3}  # 4 MiB > LIMIT
    ckptstream.save(old, path)
    with open(path, "rb") as f:
        before = f.read()
    fds = fd_count()

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    report: dict[str, Any] = {"save": None, "device_to_file": None}
    try:
        ckptstream.save(big, path, settings=ckptstream.Settings(buffer_size=256 * KiB, direct_io=direct))
    except OSError as e:
        report["save"] = error_report(e)
    with open(path, "rb") as f:
        report["unchanged"] = f.read() == before
    report["temps"] = temp_files(directory, os.path.basename(path))
    report["pool_in_use"], report["threads"] = POOL.in_use, engine_threads()
    report["fds_leaked"] = fd_count() - fds

    raw = os.path.join(directory, "raw.bin")
    try:
        ckptstream.device_to_file(big["w"], raw, settings=ckptstream.Settings(buffer_size=256 * KiB))
    except OSError as e:
        report["device_to_file"] = error_report(e)

    # the same process saves elsewhere under the limit, then the big state once the limit is lifted
    other = os.path.join(directory, "other.safetensors")
    ckptstream.save(old, other)
    assert_same_state(ckptstream.load(other), old)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    ckptstream.save(big, path, settings=ckptstream.Settings(buffer_size=256 * KiB, direct_io=direct))
    assert_same_state(ckptstream.load(path), big)
    report["recovered"] = True
    print(json.dumps(report))


if __name__ == "__main__":
    main()
