"""Measure S3 client libraries against one S3-compatible server: a multipart upload of SIZE MiB
in PART MiB parts with INFLIGHT parts in flight, and a download of the same bytes as parallel
ranged GETs into one preallocated buffer. One client and one operation per process:

    AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=us-east-1 \
        python docs/results/s3_clients.py CLIENT up|down --bucket B [--size-mib 256 --part-mib 16 --inflight 8]

CLIENT: boto3, boto3-crt, obstore, minio, s3fs. ``--copy`` (boto3 up) first copies each part into a
bounded pool of INFLIGHT buffers, as a sink that releases the staging buffers at once would.
Prints one JSON line: the seconds of the transfer itself (client made, bucket reachable, data in
memory before the clock starts) and its GB/s. ``down`` reads the object that ``up`` of the same client wrote.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MiB = 1 << 20


class ViewReader(io.RawIOBase):
    """A read-only file over a memoryview: what botocore takes as a body, without a copy."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else len(self.view) + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> Any:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = self.view[self.pos : end]
        self.pos = end
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def boto3_client(inflight: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=inflight * 2,
                                            response_checksum_validation="when_required",
                                            request_checksum_calculation="when_required"))


def boto3_up(data: memoryview, a: argparse.Namespace, key: str) -> None:
    s3 = boto3_client(a.inflight)
    part = a.part_mib * MiB
    uid = s3.create_multipart_upload(Bucket=a.bucket, Key=key)["UploadId"]
    t0 = time.perf_counter()

    spare: queue.SimpleQueue[bytearray] = queue.SimpleQueue()  # --copy: a bounded pool of part buffers
    for _ in range(a.inflight if a.copy else 0):
        spare.put(bytearray(part))

    def one(i: int) -> dict[str, Any]:
        view = data[i * part : (i + 1) * part]
        if not a.copy:
            return {"PartNumber": i + 1, "ETag": s3.upload_part(Bucket=a.bucket, Key=key, UploadId=uid,
                                                                 PartNumber=i + 1, Body=ViewReader(view))["ETag"]}
        buf = spare.get()
        try:
            buf[: len(view)] = view
            body = ViewReader(memoryview(buf)[: len(view)])
            return {"PartNumber": i + 1, "ETag": s3.upload_part(Bucket=a.bucket, Key=key, UploadId=uid,
                                                                 PartNumber=i + 1, Body=body)["ETag"]}
        finally:
            spare.put(buf)

    with ThreadPoolExecutor(a.inflight) as pool:
        parts = list(pool.map(one, range(-(-len(data) // part))))
    s3.complete_multipart_upload(Bucket=a.bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
    return t0  # type: ignore[return-value]


def boto3_down(out: memoryview, a: argparse.Namespace, key: str) -> float:
    s3 = boto3_client(a.inflight)
    s3.head_object(Bucket=a.bucket, Key=key)
    part = a.part_mib * MiB
    t0 = time.perf_counter()

    def one(i: int) -> None:
        lo, hi = i * part, min(len(out), (i + 1) * part)
        body = s3.get_object(Bucket=a.bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
        # --copy: through botocore's readinto (urllib3 reads a bytes object, then copies it into
        # the view); else http.client's own readinto, straight into the view
        stream = body if a.copy else body._raw_stream._fp
        view, got = out[lo:hi], 0
        while got < hi - lo:
            n = stream.readinto(view[got:])
            if not n:
                raise EOFError(key)
            got += n

    with ThreadPoolExecutor(a.inflight) as pool:
        list(pool.map(one, range(-(-len(out) // part))))
    return t0


def crt_manager(a: argparse.Namespace) -> Any:
    """s3transfer's CRT transfer manager, made by hand: boto3's own factory always speaks TLS,
    and the server under test is plain HTTP."""
    import botocore.session
    from s3transfer.crt import (
        BotocoreCRTCredentialsWrapper,
        BotocoreCRTRequestSerializer,
        CRTTransferManager,
        create_s3_crt_client,
    )

    session = botocore.session.Session()
    session.set_config_variable("region", os.environ.get("AWS_REGION") or session.get_config_variable("region"))
    creds = BotocoreCRTCredentialsWrapper(session.get_credentials()).to_crt_credentials_provider()
    client = create_s3_crt_client(session.get_config_variable("region"), creds, part_size=a.part_mib * MiB,
                                  use_ssl=os.environ["AWS_ENDPOINT_URL"].startswith("https"))
    return CRTTransferManager(client, BotocoreCRTRequestSerializer(session))


def crt_up(data: memoryview, a: argparse.Namespace, key: str) -> float:
    manager = crt_manager(a)
    t0 = time.perf_counter()
    manager.upload(ViewReader(data), a.bucket, key).result()
    return t0


def crt_down(out: memoryview, a: argparse.Namespace, key: str) -> float:
    manager = crt_manager(a)
    t0 = time.perf_counter()
    sink = io.BytesIO()
    manager.download(a.bucket, key, sink).result()
    out[:] = sink.getbuffer()
    return t0


def obstore_store(a: argparse.Namespace) -> Any:
    from obstore.store import S3Store

    return S3Store(a.bucket, client_options={"allow_http": True})


def obstore_up(data: memoryview, a: argparse.Namespace, key: str) -> float:
    import obstore

    store = obstore_store(a)
    t0 = time.perf_counter()
    obstore.put(store, key, data, use_multipart=True, chunk_size=a.part_mib * MiB, max_concurrency=a.inflight)
    return t0


def obstore_down(out: memoryview, a: argparse.Namespace, key: str) -> float:
    import obstore

    store = obstore_store(a)
    obstore.head(store, key)
    part = a.part_mib * MiB
    t0 = time.perf_counter()

    # one get_range per part, in threads: get_ranges merges adjacent ranges into one request, for
    # which a server may answer 200 with the whole object, and obstore then refuses the answer
    def one(i: int) -> None:
        lo, hi = i * part, min(len(out), (i + 1) * part)
        out[lo:hi] = memoryview(obstore.get_range(store, key, start=lo, end=hi))

    with ThreadPoolExecutor(a.inflight) as pool:
        list(pool.map(one, range(-(-len(out) // part))))
    return t0


def minio_client() -> Any:
    from urllib.parse import urlparse

    from minio import Minio

    url = urlparse(os.environ["AWS_ENDPOINT_URL"])
    return Minio(url.netloc, access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                 region=os.environ.get("AWS_REGION"), secure=url.scheme == "https")


def minio_up(data: memoryview, a: argparse.Namespace, key: str) -> float:
    client = minio_client()
    t0 = time.perf_counter()
    body = io.BytesIO(data)  # a copy: minio reads bytes objects only
    client.put_object(a.bucket, key, body, len(data), part_size=a.part_mib * MiB, num_parallel_uploads=a.inflight)
    return t0


def minio_down(out: memoryview, a: argparse.Namespace, key: str) -> float:
    client = minio_client()
    client.stat_object(a.bucket, key)
    part = a.part_mib * MiB
    t0 = time.perf_counter()

    def one(i: int) -> None:
        lo, hi = i * part, min(len(out), (i + 1) * part)
        resp = client.get_object(a.bucket, key, offset=lo, length=hi - lo)
        try:
            view, got = out[lo:hi], 0
            while got < hi - lo:
                n = resp.readinto(view[got:])
                if not n:
                    raise EOFError(key)
                got += n
        finally:
            resp.close()
            resp.release_conn()

    with ThreadPoolExecutor(a.inflight) as pool:
        list(pool.map(one, range(-(-len(out) // part))))
    return t0


def s3fs_fs(a: argparse.Namespace) -> Any:
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], max_concurrency=a.inflight,
                             config_kwargs={"response_checksum_validation": "when_required",
                                            "request_checksum_calculation": "when_required"})


def s3fs_up(data: memoryview, a: argparse.Namespace, key: str) -> float:
    fs = s3fs_fs(a)
    t0 = time.perf_counter()
    fs.pipe_file(f"{a.bucket}/{key}", bytes(data), chunksize=a.part_mib * MiB, max_concurrency=a.inflight)
    return t0


def s3fs_down(out: memoryview, a: argparse.Namespace, key: str) -> float:
    fs = s3fs_fs(a)
    fs.info(f"{a.bucket}/{key}")
    part = a.part_mib * MiB
    starts = list(range(0, len(out), part))
    t0 = time.perf_counter()
    got = fs.cat_ranges([f"{a.bucket}/{key}"] * len(starts), starts, [min(len(out), s + part) for s in starts],
                        batch_size=a.inflight)
    for lo, data in zip(starts, got, strict=True):
        out[lo : lo + len(data)] = data
    return t0


CLIENTS = {"boto3": (boto3_up, boto3_down), "boto3-crt": (crt_up, crt_down), "obstore": (obstore_up, obstore_down),
           "minio": (minio_up, minio_down), "s3fs": (s3fs_up, s3fs_down)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("client", choices=sorted(CLIENTS))
    p.add_argument("op", choices=["up", "down"])
    p.add_argument("--bucket", required=True)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--inflight", type=int, default=8)
    p.add_argument("--key", help="the object (default: clients/CLIENT.bin)")
    p.add_argument("--copy", action="store_true", help="boto3 up: each part copied into a bounded pool of "
                   "INFLIGHT buffers before it goes up, instead of sent from where it lies; boto3 down: read "
                   "through botocore's readinto (a copy) instead of http.client's")
    a = p.parse_args()
    key = a.key or f"clients/{a.client}.bin"
    size = a.size_mib * MiB
    up, down = CLIENTS[a.client]
    if a.op == "up":
        data = memoryview(bytearray(os.urandom(size)))
        t0 = up(data, a, key)
    else:
        data = memoryview(bytearray(size))
        data[:] = b"\xab" * size  # touched, as staging buffers are
        t0 = down(data, a, key)
    seconds = time.perf_counter() - t0
    print(json.dumps({"client": a.client + ("-copy" if a.copy else ""), "op": a.op, "mib": a.size_mib,
                      "seconds": round(seconds, 4), "gbps": round(size / seconds / 1e9, 3)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
