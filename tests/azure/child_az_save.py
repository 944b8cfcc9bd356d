"""Child of the Azure kill and memory tests.

``kill URL``: makes two states of 20 MiB (A and B, fixed seeds), then serves stdin: each line
``go K`` forks a writer that saves state K % 2 to URL (blocks of 4 MiB) and exits; this process
prints ``pid P`` at once and ``exit S`` (the writer's wait status) once it has ended. The test
kills the writer with SIGKILL at a random moment of its save. Forking from one process that has
imported torch keeps each kill cheap on a small machine.

``memory URL MIB``: saves a state of MIB MiB of 16 MiB tensors to URL and prints one JSON line:
the peak RSS growth over the RSS before the save (the state made and the client started first),
and the staging that the save held."""

from __future__ import annotations

import json
import os
import sys

import torch

import ckptstream
from ckptstream._storage import storage_for
from ckptstream.bench.measure import PeakRss

MiB = 1 << 20


def two_states() -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        out.append({f"t{i}": torch.randn(2 * MiB // 4 * (i + 1), generator=g) for i in range(4)}
                   | {"small": torch.randn(100, generator=g)})
    return out  # 2 + 4 + 6 + 8 = 20 MiB, and a small tensor


if __name__ == "__main__":
    op, url = sys.argv[1], sys.argv[2]
    if op == "kill":
        states = two_states()
        for line in sys.stdin:
            k = int(line.split()[1])
            pid = os.fork()
            if pid == 0:
                try:
                    with ckptstream.settings(buffer_size=4 * MiB, num_buffers=4, io_threads=4):
                        ckptstream.save(states[k % 2], url)
                finally:
                    os._exit(0)
            print(f"pid {pid}", flush=True)
            _, status = os.waitpid(pid, 0)
            print(f"exit {status}", flush=True)
    else:
        s = {f"t{i}": torch.randn(16 * MiB // 4) for i in range(int(sys.argv[3]) // 16)}
        storage_for(url).check_target(url)  # the client made and the container looked at before the measure
        with ckptstream.settings(buffer_size=16 * MiB, num_buffers=8, io_threads=8), PeakRss() as peak:
            ckptstream.save(s, url)
        print(json.dumps({"growth": peak.growth, "staging": ckptstream.staging_bytes()}))
