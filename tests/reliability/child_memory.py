"""Child of test_memory.py: peak host RSS of one save, load or load_into of a CPU state.

Usage: child_memory.py OP DIR MIB; prints one JSON line: the peak RSS growth over the RSS just
before the operation, the staging the operation held, and the state's bytes.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch

import ckptstream
from ckptstream import Settings
from ckptstream.bench.measure import PeakRss

SETTINGS: dict[str, Any] = {"buffer_size": 4 << 20, "num_buffers": 4, "io_threads": 4}  # 16 MiB of staging


def state(mib: int) -> dict[str, object]:
    n = mib * (1 << 20) // 4 // 4
    w = torch.randn(n)
    return {
        "w": w,
        "tied": w,  # the same tensor twice: stored once
        "t": torch.randn(n // 1024, 1024).t(),  # non-contiguous
        "rows": torch.randn(n // 512, 1024)[::2],  # a strided view into a larger storage
        "h": torch.randn(n, dtype=torch.float64).view(-1, 2)[:, 1],  # every other element
        "step": 7,
    }


def main() -> int:
    op, directory, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
    path = os.path.join(directory, "s.safetensors")
    s = state(mib)
    nbytes = sum(v.numel() * v.element_size() for k, v in s.items() if isinstance(v, torch.Tensor) and k != "tied")
    if op != "save":
        ckptstream.save(s, path, settings=Settings(**SETTINGS))
        ckptstream.release_staging()
    target: dict[str, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
    target["tied"] = target["w"]
    for t in target.values():  # pages in memory already, as a live model's are
        if isinstance(t, torch.Tensor):
            t.fill_(1)
    time.sleep(0.05)
    gc.collect()
    with PeakRss() as peak:
        if op == "save":
            ckptstream.save(s, path, settings=Settings(**SETTINGS))
        elif op == "load":
            out = ckptstream.load(path, settings=Settings(**SETTINGS))
        else:
            ckptstream.load_into(target, path, settings=Settings(**SETTINGS))
        staging = ckptstream.staging_bytes()
    if op == "load":
        assert all(torch.equal(out[k], v) for k, v in s.items() if isinstance(v, torch.Tensor))
    elif op == "load_into":
        assert all(torch.equal(target[k], v) for k, v in s.items() if isinstance(v, torch.Tensor))
    print(json.dumps({"growth": peak.growth, "staging": staging, "state": nbytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
