"""``ckptstream bench --dir s3://bucket/prefix``: ckptstream's save and load of the state on an
S3-compatible store, beside the ceilings of the same client library measured in the same run,
turn and turn about: a plain multipart upload of as many bytes (parts of ``buffer_size``,
``io_threads`` of them in flight, sent from memory without a copy) and a parallel ranged
download of them (a HEAD for the size, then GETs of ``buffer_size`` read in place into one
buffer). Everything is written under a new prefix in the one given, and removed afterwards.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import ckptstream

from .options import BenchError, Options
from .report import write_json
from .state import build_state, state_nbytes


class _ViewBody(io.RawIOBase):
    """A seekable file over a memoryview: botocore sends it, and rewinds it to retry, without a copy."""

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

    def upload(self, bucket: str, key: str, data: memoryview) -> None:
        upload_id = self.s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def one(i: int) -> dict[str, Any]:
            body = _ViewBody(data[i * self.part : (i + 1) * self.part])
            etag = self.s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=body)["ETag"]
            return {"PartNumber": i + 1, "ETag": etag}

        with ThreadPoolExecutor(self.threads) as pool:
            parts = list(pool.map(one, range(-(-len(data) // self.part))))
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

    def remove_prefix(self, bucket: str, prefix: str) -> None:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", ())]
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(opts: Options) -> int:
    if opts.ranks != 1 or opts.sweep or opts.training:
        raise BenchError("--dir s3://... measures one process's save and load: without --ranks, --sweep or --training")
    bucket, _, base = opts.dir.removeprefix("s3://").partition("/")
    prefix = f"{base.rstrip('/')}/ckptstream-bench-{uuid.uuid4().hex[:12]}/".lstrip("/")
    url = f"s3://{bucket}/{prefix}state.safetensors"
    with ckptstream.settings(**opts.staging) as cfg:
        try:
            raw = RawClient(cfg.buffer_size, cfg.io_threads)
        except ImportError as e:
            raise BenchError(f"--dir s3://... needs boto3 ({e}): pip install 'ckptstream[s3]'") from e
        state = build_state(opts.spec, opts.device)
        nbytes = state_nbytes(state)
        data = memoryview(bytearray(os.urandom(1 << 20) * (-(-nbytes // (1 << 20)))))[:nbytes]
        into = memoryview(bytearray(b"\xab" * nbytes))  # touched, as loads' fresh memory is not
        times: dict[str, list[float]] = {"upload (raw client)": [], "save": [], "download (raw client)": [],
                                         "load": []}
        print(f"ckptstream bench: {opts.spec.summary()} on {opts.device}, {opts.repeat} run(s), to {opts.dir} "
              f"(parts of {cfg.buffer_size >> 20} MiB, {cfg.io_threads} in flight)", file=sys.stderr, flush=True)
        try:
            for _ in range(opts.repeat):  # turn and turn about: a drift of the store's speed hits all alike
                times["upload (raw client)"].append(_timed(lambda: raw.upload(bucket, prefix + "raw.bin", data)))
                times["save"].append(_timed(lambda: ckptstream.save(state, url)))
                times["download (raw client)"].append(_timed(lambda: raw.download(bucket, prefix + "raw.bin", into)))
                times["load"].append(_timed(lambda: ckptstream.load(url, device=opts.device)))
                if opts.device == "cuda":
                    torch.cuda.synchronize()
        finally:
            raw.remove_prefix(bucket, prefix)
    rates = {k: [round(nbytes / s / 1e9, 4) for s in v] for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {"save": median["save"] / median["upload (raw client)"],
             "load": median["load"] / median["download (raw client)"]}
    lines = [f"{'':24s} {'GB/s (median)':>14s}  runs", *(
        f"{k:24s} {median[k]:14.3f}  {', '.join(f'{r:.3f}' for r in rates[k])}" for k in rates),
        f"save / raw upload: {ratio['save']:.2f}x   load / raw download: {ratio['load']:.2f}x"]
    print("\n".join(lines), flush=True)
    if opts.json:
        write_json({"schema": 1, "mode": "object-store", "dir": opts.dir, "device": opts.device, "bytes": nbytes,
                    "state": opts.spec.summary(), "buffer_size": cfg.buffer_size, "io_threads": cfg.io_threads,
                    "gbps": rates, "median_gbps": median, "ratio": ratio}, opts.json)
    return 0
