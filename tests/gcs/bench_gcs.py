"""Save and load on gs:// beside google-cloud-storage's own client moving the same bytes, on
gcp-storage-emulator started here (one run of each pair in turn, ckptstream first in every other
run), and the requests of one save and one load:

    PYTHONPATH=src python -m tests.gcs.bench_gcs --mib 1024 --runs 3 [--json out.json]

- save beside the client's plain upload of as many bytes (``Blob.upload_from_file``, sent from
  memory without a copy), and beside parts of ``buffer_size`` uploaded by the client
  ``io_threads`` at a time and composed (what ckptstream does, through the library's calls);
- load (new tensors) beside a parallel ranged download (``Blob.download_to_file`` of
  ``buffer_size`` ranges, ``io_threads`` at a time, into new memory).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import ckptstream
from ckptstream.bench.objectstore import _ViewBody
from tests.gcs.gcsserver import GCSServer
from tests.gcs.gcsutil import new_bucket
from tests.gcs.reqcount import counted

MiB = 1 << 20


class _ViewWriter(io.RawIOBase):
    """A file the library writes a download into: straight into ``view``."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(b)
        self._view[self._pos : self._pos + n] = b
        self._pos += n
        return n


class RawClient:
    def __init__(self, gcs: Any, bucket: str, part: int, threads: int) -> None:
        self.bucket, self.part, self.threads = gcs.bucket(bucket), part, threads

    def upload(self, key: str, data: memoryview) -> None:
        self.bucket.blob(key).upload_from_file(_ViewBody(data), size=len(data), checksum=None)

    def upload_parts(self, key: str, data: memoryview) -> None:
        def one(i: int) -> Any:
            blob = self.bucket.blob(f"{key}.parts/{i:05d}")
            blob.upload_from_file(_ViewBody(data[i * self.part : (i + 1) * self.part]), size=None, checksum=None)
            return blob

        with ThreadPoolExecutor(self.threads) as pool:
            level = list(pool.map(one, range(-(-len(data) // self.part))))
        made, depth = list(level), 0
        while len(level) > 32:
            depth += 1
            groups = [level[at : at + 32] for at in range(0, len(level), 32)]
            level = [self.bucket.blob(f"{key}.parts/c{depth}-{i}") for i in range(len(groups))]
            for dest, group in zip(level, groups, strict=True):
                dest.compose(group)
            made += level
        self.bucket.blob(key).compose(level)
        for blob in made:
            blob.delete()

    def download(self, key: str, out: memoryview) -> None:
        blob = self.bucket.get_blob(key)
        assert blob.size == len(out)

        def one(i: int) -> None:
            lo, hi = i * self.part, min(len(out), (i + 1) * self.part)
            blob.download_to_file(_ViewWriter(out[lo:hi]), start=lo, end=hi - 1, raw_download=True, checksum=None)

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(one, range(-(-len(out) // self.part))))


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    server = GCSServer()
    try:
        os.environ.update(server.env)
        bucket = new_bucket(server)
        cfg = ckptstream.Settings()
        raw = RawClient(bucket.raw, bucket.name, cfg.buffer_size, cfg.io_threads)
        state = {f"t{i}": torch.randn(64 * MiB // 4) for i in range(args.mib // 64)}
        url = bucket.url("bench/ckpt.safetensors")
        ckptstream.save(state, url)
        size = bucket.raw.bucket(bucket.name).get_blob("bench/ckpt.safetensors").size
        data = memoryview(bytearray(os.urandom(MiB)) * (size // MiB) + bytearray(size % MiB))
        with counted(url) as sent:
            ckptstream.save(state, url)
        requests = {"save": dict(sent)}
        with counted(url) as sent:
            ckptstream.load(url)
        requests["load"] = dict(sent)
        times: dict[str, list[float]] = {k: [] for k in ("save", "upload", "upload in parts + compose", "load",
                                                         "download")}
        for run in range(args.runs):
            pairs: list[tuple[str, Callable[[], Any]]] = [
                ("save", lambda: ckptstream.save(state, url)), ("upload", lambda: raw.upload("bench/raw", data)),
                ("upload in parts + compose", lambda: raw.upload_parts("bench/raw2", data)),
                ("load", lambda: ckptstream.load(url)),
                ("download", lambda: raw.download("bench/raw", memoryview(bytearray(size))))]
            order = pairs if run % 2 == 0 else [pairs[1], pairs[2], pairs[0], pairs[4], pairs[3]]
            for name, fn in order:
                times[name].append(timed(fn))
        gbps = {k: round(size / statistics.median(v) / 1e9, 4) for k, v in times.items()}
        def ratio(ours: str, theirs: str) -> float:  # the median of the runs' ratios (theirs' time / ours)
            return round(statistics.median(t / o for o, t in zip(times[ours], times[theirs], strict=True)), 3)

        paired = {"save / upload": ratio("save", "upload"),
                  "save / upload in parts + compose": ratio("save", "upload in parts + compose"),
                  "load / download": ratio("load", "download")}
        figures = {"bytes": size, "runs": args.runs, "median_gbps": gbps, "seconds": times,
                   "paired_ratio": paired, "requests": requests}
        print(json.dumps(figures, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
