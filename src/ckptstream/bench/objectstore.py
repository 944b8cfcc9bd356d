"""``ckptstream bench --dir s3://bucket/prefix``: ckptstream's save, load and load_into of the state
on an S3-compatible store, each beside the ceiling of the same client library doing the same job
in the same run:

- save beside a plain multipart upload of as many bytes (parts of ``buffer_size``, ``io_threads``
  of them in flight, sent from memory without a copy), and beside the same upload with its part
  1 sent last, as a save sends its head (a store that writes parts out in order, as rclone's
  does, holds every other part until part 1 comes: this row shows what that costs there);
- load, which returns new tensors, beside a parallel ranged download (a HEAD for the size, then
  GETs of ``buffer_size`` read in place) into new memory of the kind a load allocates;
- load_into, which fills tensors that exist, beside the same download into a buffer that exists.

Each run takes the pairs in turn, ckptstream first in every other run, so that a drift of the
store's speed falls on both sides alike. Before the reads of a run, each object written is looked
at once (a HEAD, not timed): a cost a store pays once per new object on its first read (rclone
computes the object's MD5 for its ETag then) falls on neither side's clock. The
process's CPU time of each transfer is kept beside its wall time. Everything is written under a
new prefix in the one given, and removed afterwards.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import ckptstream

from .options import BenchError, Options
from .report import write_json
from .state import assert_same, build_state, empty_like_state, state_nbytes

UPLOAD, UPLOAD_LAST, SAVE = "upload (raw client)", "upload, part 1 last (raw client)", "save"
DOWNLOAD_NEW, LOAD = "download to new memory (raw client)", "load"
DOWNLOAD_IN_PLACE, LOAD_INTO = "download in place (raw client)", "load_into"
ROWS = (UPLOAD, UPLOAD_LAST, SAVE, DOWNLOAD_NEW, LOAD, DOWNLOAD_IN_PLACE, LOAD_INTO)
PAIRS = {SAVE: UPLOAD, LOAD: DOWNLOAD_NEW, LOAD_INTO: DOWNLOAD_IN_PLACE}  # ckptstream's -> its ceiling


class _ViewBody(io.RawIOBase):
    """A seekable file over a memoryview: botocore sends it, and rewinds it to retry, without a copy.
    (The library's twin is not used: the ceiling is the client alone, and the benchmark uses the
    public API only.)"""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> Any:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = self._view[self._pos : end]
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        memoryview(b).cast("B")[: len(data)] = data
        return len(data)


class RawClient:
    """The client library ckptstream uses, configured as ckptstream configures it, driven plainly."""

    def __init__(self, part: int, threads: int) -> None:
        import boto3
        from botocore.config import Config

        config = Config(max_pool_connections=64, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
        self.s3 = boto3.client("s3", region_name=os.environ.get("AWS_REGION") or None, config=config)
        self.part, self.threads = part, threads

    def upload(self, bucket: str, key: str, data: memoryview, *, first_part_last: bool = False) -> None:
        """Parts in order, ``threads`` at a time; with ``first_part_last``, part 1 alone once the
        others are up."""
        upload_id = self.s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def one(i: int) -> dict[str, Any]:
            body = _ViewBody(data[i * self.part : (i + 1) * self.part])
            etag = self.s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=body)["ETag"]
            return {"PartNumber": i + 1, "ETag": etag}

        count, skip = -(-len(data) // self.part), int(first_part_last)
        with ThreadPoolExecutor(self.threads) as pool:
            parts = list(pool.map(one, range(skip, count)))
        parts = [one(0), *parts] if skip else parts
        self.s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})

    def download(self, bucket: str, key: str, out: memoryview) -> None:
        size = self.s3.head_object(Bucket=bucket, Key=key)["ContentLength"]
        if size != len(out):
            raise BenchError(f"s3://{bucket}/{key} holds {size} bytes, expected {len(out)}")

        def one(i: int) -> None:
            lo, hi = i * self.part, min(len(out), (i + 1) * self.part)
            body = self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
            raw = getattr(getattr(body, "_raw_stream", None), "_fp", None)
            readinto = raw.readinto if raw is not None else body.readinto  # in place where the layers allow
            view, got = out[lo:hi], 0
            while got < hi - lo:
                n = readinto(view[got:])
                if not n:
                    raise BenchError(f"s3://{bucket}/{key}: the body of bytes {lo}..{hi} ended early")
                got += n
            body.close()

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(one, range(-(-len(out) // self.part))))

    def settle(self, bucket: str, *keys: str) -> None:
        """One HEAD of each object: whatever the store does on the first read of a new object is
        done before the reads are timed."""
        for key in keys:
            self.s3.head_object(Bucket=bucket, Key=key)

    def remove_prefix(self, bucket: str, prefix: str) -> None:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", ())]
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})


@contextlib.contextmanager
def new_memory(nbytes: int) -> Iterator[memoryview]:
    """``nbytes`` of memory never touched before, of the kind a load allocates for its tensors
    (anonymous, private, advised for huge pages): the download pays for its first touch as the
    load does."""
    area = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            area.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(area)[:nbytes]
    try:
        yield view
    finally:
        view.release()
        area.close()


class Timings:
    """Wall and CPU seconds (this process's user + system) of each transfer, by row."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {k: [] for k in ROWS}
        self.cpu: dict[str, list[float]] = {k: [] for k in ROWS}

    def time(self, row: str, fn: Callable[[], Any]) -> Any:
        t, c = time.perf_counter(), _cpu()
        out = fn()
        self.cpu[row].append(_cpu() - c)
        self.wall[row].append(time.perf_counter() - t)
        return out


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _in_turn(first_raw: bool, *raw: Callable[[], Any], ours: Callable[[], Any]) -> Any:
    """Run the raw client's transfers and then ckptstream's, or the other way round; returns
    ckptstream's result."""
    if first_raw:
        for fn in raw:
            fn()
        return ours()
    out = ours()
    for fn in reversed(raw):
        fn()
    return out


def run(opts: Options) -> int:
    if opts.ranks != 1 or opts.sweep or opts.training:
        raise BenchError("--dir s3://... measures one process's save and load: without --ranks, --sweep or --training")
    bucket, _, base = opts.dir.removeprefix("s3://").partition("/")
    prefix = f"{base.rstrip('/')}/ckptstream-bench-{uuid.uuid4().hex[:12]}/".lstrip("/")
    url, raw_key, last_key = f"s3://{bucket}/{prefix}state.safetensors", prefix + "raw.bin", prefix + "raw-last.bin"
    with ckptstream.settings(**opts.staging) as cfg:
        try:
            raw = RawClient(cfg.buffer_size, cfg.io_threads)
        except ImportError as e:
            raise BenchError(f"--dir s3://... needs boto3 ({e}): pip install 'ckptstream[s3]'") from e
        state = build_state(opts.spec, opts.device)
        into_state = empty_like_state(state, resident=True)  # a live model's tensors: in memory already
        nbytes = state_nbytes(state)
        data = memoryview(bytearray(os.urandom(1 << 20) * (-(-nbytes // (1 << 20)))))[:nbytes]
        into = memoryview(bytearray(b"\xab" * nbytes))  # touched: in memory already
        t = Timings()
        print(f"ckptstream bench: {opts.spec.summary()} on {opts.device}, {opts.repeat} run(s), to {opts.dir} "
              f"(parts of {cfg.buffer_size >> 20} MiB, {cfg.io_threads} in flight)", file=sys.stderr, flush=True)

        def download_new() -> None:
            with new_memory(nbytes) as fresh:
                raw.download(bucket, raw_key, fresh)

        def load() -> Any:
            out = ckptstream.load(url, device=opts.device)
            if opts.device == "cuda":
                torch.cuda.synchronize()
            return out

        def load_into() -> None:
            ckptstream.load_into(into_state, url)
            if opts.device == "cuda":
                torch.cuda.synchronize()

        try:
            for i in range(opts.repeat):
                first_raw = i % 2 == 0
                _in_turn(first_raw, lambda: t.time(UPLOAD, lambda: raw.upload(bucket, raw_key, data)),
                         lambda: t.time(UPLOAD_LAST, lambda: raw.upload(bucket, last_key, data, first_part_last=True)),
                         ours=lambda: t.time(SAVE, lambda: ckptstream.save(state, url)))
                raw.settle(bucket, raw_key, last_key, url.removeprefix(f"s3://{bucket}/"))
                loaded = _in_turn(first_raw, lambda: t.time(DOWNLOAD_NEW, download_new),
                                  ours=lambda: t.time(LOAD, load))
                assert_same(state, loaded, "load")  # a benchmark of a wrong load is void
                del loaded  # freed before the next run's loads, as the download's memory is
                _in_turn(first_raw, lambda: t.time(DOWNLOAD_IN_PLACE, lambda: raw.download(bucket, raw_key, into)),
                         ours=lambda: t.time(LOAD_INTO, load_into))
            if into != data:
                raise BenchError(f"s3://{bucket}/{raw_key}: the bytes downloaded differ from those uploaded")
            assert_same(state, into_state, "load_into")
        finally:
            raw.remove_prefix(bucket, prefix)
    report = _report(opts, nbytes, cfg.buffer_size, cfg.io_threads, t)
    print(_text(report), flush=True)
    if opts.json:
        write_json(report, opts.json)
    return 0


def _report(opts: Options, nbytes: int, buffer_size: int, io_threads: int, t: Timings) -> dict[str, Any]:
    rates = {k: [round(nbytes / s / 1e9, 4) for s in v] for k, v in t.wall.items()}
    median = {k: statistics.median(v) for k, v in rates.items()}
    paired = {ours: [a / b for a, b in zip(rates[ours], rates[ceiling], strict=True)]
              for ours, ceiling in PAIRS.items()}
    return {"schema": 2, "mode": "object-store", "dir": opts.dir, "device": opts.device, "bytes": nbytes,
            "state": opts.spec.summary(), "buffer_size": buffer_size, "io_threads": io_threads, "runs": opts.repeat,
            "gbps": rates, "median_gbps": median,
            # the headline: the median rate over the ceiling's median rate
            "ratio": {ours: median[ours] / median[ceiling] for ours, ceiling in PAIRS.items()},
            # run by run (the two members of a pair ran one after the other): median and range
            "paired_ratio": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                             for k, v in paired.items()},
            "save_vs_same_order": median[SAVE] / median[UPLOAD_LAST],
            "cpu_s": {k: [round(c, 3) for c in v] for k, v in t.cpu.items()},
            "median_cpu_s": {k: statistics.median(v) for k, v in t.cpu.items()}}


def _text(report: dict[str, Any]) -> str:
    rates, median, cpu = report["gbps"], report["median_gbps"], report["median_cpu_s"]
    lines = [f"{'':36s} {'GB/s (median)':>13s} {'CPU s':>6s}  runs"]
    lines += [f"{k:36s} {median[k]:13.3f} {cpu[k]:6.2f}  {', '.join(f'{r:.3f}' for r in rates[k])}" for k in rates]
    for ours, ceiling in PAIRS.items():
        p = report["paired_ratio"][ours]
        lines.append(f"{ours} / {ceiling}: {report['ratio'][ours]:.2f}x (run by run: median {p['median']:.2f}x, "
                     f"{p['min']:.2f}-{p['max']:.2f}x)")
    lines.append(f"{SAVE} / {UPLOAD_LAST}: {report['save_vs_same_order']:.2f}x")
    return "\n".join(lines)
