"""Figures of az:// URLs on Azurite: ckptstream's save and load of a state beside azure-storage-
blob's own client moving the same bytes (``upload_blob`` / ``download_blob`` with
``max_concurrency``, blocks of ckptstream's buffer_size), paired (each run takes both, in turn
first), with each side's requests counted and the peak RSS growth of ckptstream's transfers. A
load is paired with a download into new memory, as a load fills memory it allocates (its first
touch, page by page, is in both); ``load_into`` (tensors that exist) with a download into
memory touched before.

    python -m tests.azure.azure_bench --mib 1024 --runs 3 [--json out.json]

Starts its own Azurite (``tests/azure/azurite.py``); the process's RSS is measured around each
of ckptstream's transfers (save: over the state; load: over the state it returns).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import threading
import time
from typing import Any

import torch

import ckptstream
from ckptstream._storage import register
from ckptstream._storage.azure import AzureStorage
from ckptstream.bench.measure import PeakRss
from tests.azure.azurite import AzuriteServer

MiB = 1 << 20
ROWS = ("save", "upload_blob", "load", "download_blob", "load_into", "download_blob in place")


class Counter:
    """Requests answered, by operation (the method and the ``comp`` query)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, response: Any) -> None:
        request = response.http_request
        comp = next((q[5:] for q in request.url.partition("?")[2].split("&") if q.startswith("comp=")), "")
        with self._lock:
            self.counts[f"{request.method} {comp}".strip()] += 1

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self.counts = dict(self.counts), collections.Counter()
        return out


class Into:
    """A writable, seekable file over a memoryview: download_blob writes into it in place."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        n = len(data)
        self._view[self._pos : self._pos + n] = data
        self._pos += n
        return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    server = AzuriteServer()
    try:
        figures = measure(server, args.mib, args.runs)
    finally:
        server.stop()
    for row in ROWS:
        print(f"{row:>14}: {statistics.median(figures['gbps'][row]):.3f} GB/s (median of {args.runs}), "
              f"requests {figures['requests'][row]}")
    print(f"paired ratios: save/upload_blob {figures['ratio']['save']:.2f}, "
          f"load/download_blob {figures['ratio']['load']:.2f}, "
          f"load_into/download_blob in place {figures['ratio']['load_into']:.2f}")
    print(f"peak RSS growth: save {figures['rss']['save'] / MiB:.0f} MiB, load {figures['rss']['load'] / MiB:.0f} MiB "
          f"over the state; staging {figures['staging'] / MiB:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


def measure(server: AzuriteServer, mib: int, runs: int) -> dict[str, Any]:
    from azure.storage.blob import BlobServiceClient

    with ckptstream.settings() as cfg:  # the settings in force (the environment's)
        pass
    ours, theirs = Counter(), Counter()
    register("az", lambda: AzureStorage(connection_string=server.connection_string, raw_response_hook=ours))
    service = BlobServiceClient.from_connection_string(
        server.connection_string, max_block_size=cfg.buffer_size, max_single_put_size=cfg.buffer_size,
        max_chunk_get_size=cfg.buffer_size, max_single_get_size=cfg.buffer_size, raw_response_hook=theirs)
    service.create_container("bench")
    flat = torch.randn(mib * MiB // 4)
    state = {f"t{i:03d}": t for i, t in enumerate(flat.split(16 * MiB // 4))}
    raw = memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]
    url, blob = "az://bench/state.safetensors", service.get_blob_client("bench", "raw.bin")
    gbps: dict[str, list[float]] = {k: [] for k in ROWS}
    paired: dict[str, list[float]] = {"save": [], "load": [], "load_into": []}
    requests: dict[str, dict[str, int]] = {}
    rss = {"save": 0, "load": 0}
    raw_bytes = bytes(raw)  # upload_blob takes bytes, not a memoryview (its chunker concatenates)
    out = bytearray(len(raw))  # the in-place download's target, touched once before the runs
    targets = {k: torch.full_like(v, math.nan) for k, v in state.items()}  # load_into's, likewise
    loaded: list[dict[str, torch.Tensor]] = []
    downloaded: list[bytearray] = []

    def timed(row: str, fn: Any) -> Any:
        t = time.perf_counter()
        result = fn()
        gbps[row].append(len(raw) / (time.perf_counter() - t) / 1e9)
        return result

    def save() -> None:
        with PeakRss() as peak:
            ckptstream.save(state, url)
        rss["save"] = max(rss["save"], peak.growth)

    def load() -> None:
        with PeakRss() as peak:
            loaded.append(ckptstream.load(url))
        rss["load"] = max(rss["load"], peak.growth - len(raw))

    def load_into() -> None:
        ckptstream.load_into(targets, url)

    def upload() -> None:
        blob.upload_blob(raw_bytes, length=len(raw), overwrite=True, max_concurrency=cfg.io_threads)

    def download() -> None:  # into new memory
        fresh = bytearray(len(raw))  # calloc'd: its pages are touched by the download's writes
        blob.download_blob(max_concurrency=cfg.io_threads).readinto(Into(memoryview(fresh)))  # type: ignore[arg-type]
        downloaded.append(fresh)

    def download_in_place() -> None:
        blob.download_blob(max_concurrency=cfg.io_threads).readinto(Into(memoryview(out)))  # type: ignore[arg-type]

    for r in range(runs):
        for ckpt_row, raw_row, ckpt, plain in (("save", "upload_blob", save, upload),
                                               ("load", "download_blob", load, download),
                                               ("load_into", "download_blob in place", load_into, download_in_place)):
            order = [(ckpt_row, ckpt, ours), (raw_row, plain, theirs)]
            for row, fn, counter in order if r % 2 == 0 else order[::-1]:
                counter.take()
                timed(row, fn)
                requests[row] = counter.take()
            paired[ckpt_row].append(gbps[ckpt_row][-1] / gbps[raw_row][-1])
        back = loaded.pop()  # both checked outside the timing
        assert all(torch.equal(back[k], state[k]) for k in state)
        assert downloaded.pop() == raw_bytes
        del back
    assert out == raw_bytes  # the in-place download's bytes, exactly
    assert all(torch.equal(targets[k], state[k]) for k in state)
    register("az", None)
    return {"mib": mib, "runs": runs, "buffer_size": cfg.buffer_size, "io_threads": cfg.io_threads,
            "staging": ckptstream.staging_bytes(), "gbps": gbps, "requests": requests, "rss": rss,
            "ratio": {k: statistics.median(v) for k, v in paired.items()}, "paired": paired}


if __name__ == "__main__":
    sys.exit(main())
