"""Failures against a real S3 server: each a typed error naming the URL, and nothing lost or
left visible: missing credentials, a missing bucket, denied access, throttling (retried, then
raised), a connection lost mid-upload, a writer killed mid-upload (its upload aborted by the
next writer of the key), and which leftover uploads a writer aborts."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptstream
from ckptstream._storage import objstore, s3journal, storage_for
from tests.helpers import child_env
from tests.s3.faultproxy import FaultProxy
from tests.s3.s3server import S3Server, require_rclone
from tests.s3.s3util import (  # noqa: F401
    Bucket,
    MiB,
    boto,
    raw_client,
    reset_clients,
    s3,
    s3_server,
    use_server,
    write_like_the_engine,
)

STORE = storage_for("s3://any")
HERE = Path(__file__).parent


def test_no_credentials(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    reset_clients()
    url = s3.url("a/ckpt")
    for call in (lambda: STORE.open(url), lambda: STORE.create(url), lambda: STORE.list_folder(s3.url("a"))):
        with pytest.raises(ckptstream.NoCredentialsError, match=r"no credentials.*AWS_ACCESS_KEY_ID.*s3://") as info:
            call()
        assert isinstance(info.value, PermissionError)
        assert info.value.url.startswith(url[:-6])


def test_missing_bucket(s3: Bucket) -> None:
    url = "s3://no-such-bucket-here/a/ckpt"
    for call in (lambda: STORE.open(url), lambda: STORE.create(url), lambda: STORE.size(url),
                 lambda: STORE.list_folder("s3://no-such-bucket-here/a")):
        missing = r"'no-such-bucket-here' does not exist.*s3://"
        with pytest.raises(ckptstream.BucketNotFoundError, match=missing) as info:
            call()
        assert isinstance(info.value, FileNotFoundError)


def test_missing_object(s3: Bucket) -> None:
    with pytest.raises(ckptstream.ObjectNotFoundError, match=r"no such object.*s3://.*/none") as info:
        STORE.open(s3.url("none"))
    assert isinstance(info.value, FileNotFoundError)


def test_access_denied(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.put("a/ckpt", b"old")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    reset_clients()
    url = s3.url("a/ckpt")
    for call in (lambda: STORE.open(url), lambda: STORE.create(url), lambda: STORE.list_folder(s3.url("a"))):
        denied = r"access denied \((opening|listing|looking).*(SignatureDoesNotMatch|403).*s3://"
        with pytest.raises(ckptstream.AccessDeniedError, match=denied) as info:
            call()
        assert isinstance(info.value, PermissionError)
    assert s3.get("a/ckpt") == b"old"


@pytest.fixture
def one_upload_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Bucket, Any]]:
    """A server that takes one multipart upload at a time (more: SlowDown), with one held open."""
    require_rclone()
    server = S3Server("--multipart-max-uploads", "1")
    try:
        use_server(monkeypatch, tmp_path, server.env)
        raw = raw_client(server.env)
        raw.create_bucket(Bucket="throttled")
        holder = raw.create_multipart_upload(Bucket="throttled", Key="other")["UploadId"]
        yield Bucket(server, "throttled", raw), holder
    finally:
        reset_clients()
        server.stop()


def test_throttling_is_retried_then_raised(one_upload_server: tuple[Bucket, Any],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, holder = one_upload_server
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    reset_clients()
    attempts = []
    boto().meta.events.register("needs-retry.s3.CreateMultipartUpload",
                                           lambda attempts_=None, **kw: attempts.append(kw["attempts"]))
    with pytest.raises(ckptstream.ThrottledError, match=r"throttled.*SlowDown.*2 attempts.*s3://throttled/a/ckpt"), \
            STORE.create(bucket.url("a/ckpt")) as sink:
        write_like_the_engine(sink, os.urandom(12 * MiB), 4096, 5 * MiB, threads=1)
    assert attempts == [1, 2]
    assert bucket.keys() == []
    assert bucket.uploads() == [holder]


def test_throttling_that_ends_is_ridden_out(one_upload_server: tuple[Bucket, Any]) -> None:
    """The store says SlowDown until the other upload ends (here: at the first retry decision)."""
    bucket, holder = one_upload_server

    ended: list[int] = []

    def end_the_other(**kwargs: Any) -> None:  # called after every attempt, the last one's success too
        if not ended:
            ended.append(kwargs["attempts"])
            bucket.raw.abort_multipart_upload(Bucket="throttled", Key="other", UploadId=holder)

    boto().meta.events.register_first("needs-retry.s3.CreateMultipartUpload", end_the_other,
                                                 unique_id="end-the-other")
    data = os.urandom(12 * MiB)
    with STORE.create(bucket.url("a/ckpt")) as sink:
        write_like_the_engine(sink, data, 4096, 5 * MiB, threads=1)
    assert ended == [1]  # the first attempt was told to slow down, the second went through
    assert bucket.get("a/ckpt") == data
    assert bucket.uploads() == []


def test_connection_lost_mid_upload(s3: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    old = os.urandom(1000)
    s3.put("a/ckpt", old)
    host, port = s3.server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), cut_after=12 * MiB)
    try:
        use_server(monkeypatch, tmp_path, {**s3.server.env, "AWS_ENDPOINT_URL": proxy.endpoint,
                                           "AWS_MAX_ATTEMPTS": "2"})
        with pytest.raises(ckptstream.ConnectionLostError, match=r"connection.*failed.*s3://.*/a/ckpt") as info, \
                STORE.create(s3.url("a/ckpt")) as sink:
            write_like_the_engine(sink, os.urandom(40 * MiB), 4096, 5 * MiB)
        assert isinstance(info.value, ConnectionError)
        assert proxy.cut.is_set()
    finally:
        proxy.close()
    assert s3.get("a/ckpt") == old
    assert s3.keys() == ["a/ckpt"]
    assert len(s3.uploads()) == 1  # the abort could not reach the store either
    assert len(os.listdir(s3journal.directory())) == 1  # noted as this process's, abandoned
    use_server(monkeypatch, tmp_path, s3.server.env)  # the link is back: the next save cleans up
    data = os.urandom(6 * MiB)
    with STORE.create(s3.url("a/ckpt")) as sink:
        assert s3.uploads() == []
        write_like_the_engine(sink, data, 4096, 5 * MiB)
    assert s3.get("a/ckpt") == data
    assert os.listdir(s3journal.directory()) == []


def test_a_read_whose_connection_breaks_asks_again_for_the_rest(s3: Bucket, monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    data = os.urandom(12 * MiB)
    s3.put("r", data)
    host, port = s3.server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), cut_after_down=5 * MiB, refuse=False)
    try:
        use_server(monkeypatch, tmp_path, {**s3.server.env, "AWS_ENDPOINT_URL": proxy.endpoint})
        out = bytearray(len(data))
        with STORE.open(s3.url("r")) as source:
            assert source.read_into(memoryview(out), 0) == len(data)
        assert proxy.cut.is_set()  # the body broke midway and the rest came in a second GET
    finally:
        proxy.close()
    assert out == data


def test_killed_writer_leaves_nothing_and_the_next_save_aborts_its_upload(s3: Bucket) -> None:
    old = os.urandom(1000)
    s3.put("a/ckpt", old)
    env = child_env()
    with subprocess.Popen([sys.executable, str(HERE / "child_upload.py"), s3.url("a/ckpt")], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "parts up\n"
            assert len(s3.uploads("a/ckpt")) == 1
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert s3.get("a/ckpt") == old
    assert s3.keys() == ["a/ckpt"]
    assert len(s3.uploads("a/ckpt")) == 1
    data = os.urandom(3 * MiB)
    assert len(os.listdir(s3journal.directory())) == 1  # the dead writer's note
    with STORE.create(s3.url("a/ckpt")) as sink:  # the dead writer's upload goes first
        assert s3.uploads("a/ckpt") == []
        write_like_the_engine(sink, data, 4096, 5 * MiB)
    assert s3.get("a/ckpt") == data
    assert os.listdir(s3journal.directory()) == []


def test_which_leftover_uploads_are_aborted(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``stale_only``, a writer's own upload in flight is never aborted, another's fresh one
    only once untouched for STALE_AFTER; without, every upload of the key goes (the caller knows
    no writer is left: the storage contract's "all"), and the writer learns so when it
    publishes; other keys' never."""
    live = STORE.create(s3.url("k"))
    write_like_the_engine(live, os.urandom(12 * MiB), 4096, 5 * MiB)
    mine = s3.uploads("k")
    other = s3.raw.create_multipart_upload(Bucket=s3.name, Key="k")["UploadId"]
    neighbour = s3.raw.create_multipart_upload(Bucket=s3.name, Key="k2")["UploadId"]
    assert STORE.remove_temps(s3.url("k")) == []
    with monkeypatch.context() as m:
        m.setattr(objstore, "STALE_AFTER", datetime.timedelta(0))
        assert STORE.remove_temps(s3.url("k")) == [other]
    other = s3.raw.create_multipart_upload(Bucket=s3.name, Key="k")["UploadId"]
    assert sorted(STORE.remove_temps(s3.url("k"), stale_only=False)) == sorted([*mine, other])
    assert s3.uploads() == [neighbour]
    with pytest.raises(OSError, match=re.escape(s3.url("k"))):  # naming the object
        live.publish()
    assert s3.uploads() == [neighbour]
    assert s3.keys("k") == []


def test_a_journal_that_cannot_be_written_fails_no_save(s3: Bucket, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_bytes(b"")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))  # no journal can be made under it
    data = os.urandom(12 * MiB)
    with STORE.create(s3.url("k")) as sink:
        write_like_the_engine(sink, data, 4096, 5 * MiB)
    assert s3.get("k") == data
    assert s3.uploads() == []
