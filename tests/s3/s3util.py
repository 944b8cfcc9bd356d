"""Fixtures and helpers of the object-store tests: the session's server (``s3_server``), a fresh
bucket per test reached through the standard AWS variables (``s3``), and a raw client to look at
the bucket behind ckptstream's back. Test modules import the fixtures by name."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstream._storage import storage_for
from ckptstream._storage.s3 import reset_clients as reset_clients
from tests.s3.s3server import S3Server, require_rclone, shared_server

# the AWS configuration a test must not inherit from the machine it runs on
_FOREIGN = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
            "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_CA_BUNDLE")


def raw_client(env: dict[str, str]) -> Any:
    """A plain boto3 client of the server (what a person inspecting the bucket would use)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"],
                        config=Config(response_checksum_validation="when_required",
                                      request_checksum_calculation="when_required"))


def boto() -> Any:
    """The boto3 client of the storage ``s3://`` URLs reach, for the settings in force (to hook
    its events)."""
    return storage_for("s3://any").client().boto  # type: ignore[attr-defined]


@dataclasses.dataclass
class Bucket:
    server: S3Server
    name: str
    raw: Any

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def get(self, key: str) -> bytes:
        data: bytes = self.raw.get_object(Bucket=self.name, Key=key)["Body"].read()
        return data

    def put(self, key: str, data: bytes) -> None:
        self.raw.put_object(Bucket=self.name, Key=key, Body=data)

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.raw.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))

    def uploads(self, key: str = "") -> list[str]:
        """The ids of the incomplete multipart uploads under ``key``."""
        try:
            page = self.raw.list_multipart_uploads(Bucket=self.name, Prefix=key)
        except self.raw.exceptions.NoSuchUpload:  # rclone's answer for a bucket that never had one
            return []
        return [u["UploadId"] for u in page.get("Uploads", ())]


def use_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]) -> None:
    """Point the standard AWS variables (and nothing else of the machine's) at ``env``'s server;
    the upload journal goes under ``tmp_path``."""
    for name in _FOREIGN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))  # none: no profile of the machine
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    reset_clients()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    require_rclone()
    with shared_server() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Bucket]:
    """A new, empty bucket on the session's server, which ``s3://`` URLs reach."""
    use_server(monkeypatch, tmp_path, s3_server.env)
    raw = raw_client(s3_server.env)
    name = f"ckpt-{uuid.uuid4().hex[:16]}"
    raw.create_bucket(Bucket=name)
    yield Bucket(s3_server, name, raw)
    reset_clients()


MiB = 1 << 20


def chunks_of(total: int, header: int, grid: int) -> list[tuple[int, int]]:
    """The byte ranges the write engine writes after a header: back to back from the header's end,
    each ending on the grid (at most one grid cell each)."""
    out, pos = [], header
    while pos < total:
        stop = min(total, (pos // grid + 1) * grid)
        out.append((pos, stop))
        pos = stop
    return out


def write_like_the_engine(sink: Any, data: bytes, header: int, buffer_size: int, *, threads: int = 4,
                          skip: int | None = None) -> None:
    """Write ``data`` into ``sink`` as a checkpoint writer does: the header (placeholders) at 0,
    the grid's chunks from several threads in a scrambled order, then the header again (its
    final bytes). ``skip``: leave out that chunk (a writer's bug)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from ckptstream._settings import DirectIO

    view = memoryview(data)
    sink.write_at(memoryview(bytes(header)), 0)
    grid = sink.grid(buffer_size, DirectIO.AUTO)
    chunks = chunks_of(len(data), header, grid)
    if skip is not None:
        del chunks[skip]
    random.Random(len(data)).shuffle(chunks)
    with ThreadPoolExecutor(threads) as pool:  # the first failure stops the chunks not yet begun
        futures = [pool.submit(sink.write_at, view[lo:hi], lo) for lo, hi in chunks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    sink.write_at(view[:header], 0)
