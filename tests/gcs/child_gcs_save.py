"""Child of the gs:// tests. ``loop URL``: saves state 0, 1, 2, ... (each of ``state(i)``, 24 MiB
in parts of 5 MiB) to URL over and over, saying "ready" once the client is made, until it is
killed. ``memory URL MIB``: saves a state of MIB MiB of 16 MiB tensors to URL and prints one JSON
line: the peak RSS growth over the RSS before the save, and the staging the save held.
``memory-load URL MIB``: the same state saved, then loaded into tensors that exist (load_into),
the growth measured over that load."""

from __future__ import annotations

import json
import sys

import torch

import ckptstream
from ckptstream._storage import storage_for
from ckptstream.bench.measure import PeakRss

MiB = 1 << 20


def state(i: int) -> dict[str, torch.Tensor]:
    """The i-th state of a loop: its bytes follow from i (the parent checks an object against it)."""
    g = torch.Generator().manual_seed(i)
    return {"a": torch.randn(5 * MiB // 4 * 3, generator=g), "b": torch.randn(9 * MiB // 4, generator=g),
            "i": torch.tensor([i])}


if __name__ == "__main__":
    op, url = sys.argv[1], sys.argv[2]
    storage_for(url).check_target(url)  # the client made and the bucket looked at first
    if op == "loop":
        states = [state(i) for i in range(4)]
        print("ready", flush=True)
        with ckptstream.settings(buffer_size=5 * MiB):
            i = 0
            while True:
                ckptstream.save(states[i % len(states)], url)
                i += 1
    else:
        s = {f"t{i}": torch.randn(16 * MiB // 4) for i in range(int(sys.argv[3]) // 16)}
        with ckptstream.settings(buffer_size=16 * MiB, num_buffers=8, io_threads=8):
            if op == "memory-load":
                ckptstream.save(s, url)
                s = {k: torch.full_like(v, float("nan")) for k, v in s.items()}  # resident before the measure
                with PeakRss() as peak:
                    ckptstream.load_into(s, url)
            else:
                with PeakRss() as peak:
                    ckptstream.save(s, url)
        print(json.dumps({"growth": peak.growth, "staging": ckptstream.staging_bytes()}))
