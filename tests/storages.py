"""The storages every contract test runs on: one entry of ``TARGETS`` each (a name and a factory
that gives a test a fresh, empty ``Place`` there). A new storage proves itself by adding its
entry and passing the tests that take the ``storage`` or ``place`` fixture (tests/conftest.py):

    TARGETS = [..., Target("foo", foo_place)]   # foo_place(request, tmp_path) -> Place

A ``Place`` is a folder of the storage for one test, with ways to look at and spoil what is
stored behind the storage's back (raw bytes, leftovers of unfinished writes) and the two ways
the seam lets a storage differ (``empty_folders``, ``lock_refuses``: see ``Place``).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import re
import socket
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ckptstream._storage import Storage, publish, storage_for
from tests.memstore import Crash, MemSink, MemStorage

MiB = 1 << 20
DEAD_PID = 2**22 + 12345  # above any pid_max: a process certainly gone


class Place(abc.ABC):
    """Where a test's files live: ``root``, a folder of ``storage``, empty at the start."""

    name: str  # the target's, as in the test ids
    root: str
    storage: Storage
    # whether a folder made and left empty exists (is listed, has a kind); on an object store a
    # folder is a prefix, there while an object lies under it
    empty_folders = True
    # whether a second ``lock`` of a held lock raises LockHeldError; else (an object store) it
    # takes the record over, and the first holder's ``check`` raises
    lock_refuses = True
    # a write this far into a sink has left something behind (an object store keeps its first
    # part back until the end: an upload begins with the next)
    begun_at = 0

    def path(self, name: str) -> str:
        return self.storage.join(self.root, name)

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The stored bytes of ``path``, read behind the storage's back."""

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """Replace the stored bytes of ``path`` behind the storage's back."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Every name stored under ``root`` (relative, "/"-separated, at any depth), and what
        every unfinished write left: a local temp by its name, an upload as ``pending:<name>``."""

    @abc.abstractmethod
    def leave_dead_writer(self, path: str) -> None:
        """Leave what a writer of ``path`` that was killed mid-write leaves (a temp of a gone
        process, an upload nobody will complete), which ``remove_temps`` takes as stale."""

    def header(self, path: str) -> dict[str, Any]:
        """The parsed JSON header of the stored safetensors file."""
        raw = self.read_bytes(path)
        (n,) = struct.unpack("<Q", raw[:8])
        header: dict[str, Any] = json.loads(raw[8 : 8 + n])
        return header

    def flip(self, path: str, offset: int) -> None:
        """Corrupt one bit of the byte at ``offset`` of the stored object."""
        raw = bytearray(self.read_bytes(path))
        raw[offset] ^= 0x01
        self.write_bytes(path, bytes(raw))

    def truncate(self, path: str, length: int) -> None:
        """Cut the stored object short."""
        self.write_bytes(path, self.read_bytes(path)[:length])


# --- the local file system -----------------------------------------------------------------------


class LocalPlace(Place):
    def __init__(self, root: Path) -> None:
        self.name, self.root, self.storage = "local", str(root), storage_for(str(root))

    def read_bytes(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def write_bytes(self, path: str, data: bytes) -> None:
        Path(path).write_bytes(data)

    def names(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in Path(self.root).rglob("*") if not p.is_dir())

    def leave_dead_writer(self, path: str) -> None:
        dead = publish.temp_path_for(path).rsplit("-", 2)[0]  # a temp's name on this host, in this namespace
        Path(f"{dead}-{DEAD_PID}-0123456789ab").write_bytes(b"x")


def local_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    return LocalPlace(tmp_path)


# --- the in-memory storage of the tests (tests/memstore.py) ----------------------------------------


class MemPlace(Place):
    def __init__(self, store: MemStorage) -> None:
        self.name, self.root, self.storage, self.store = "mem", "mem://test", store, store
        store.make_folders(self.root)

    def read_bytes(self, path: str) -> bytes:
        return self.store.objects[path]

    def write_bytes(self, path: str, data: bytes) -> None:
        self.store.objects[path] = data

    def names(self) -> list[str]:
        prefix = self.root + "/"
        return sorted([n.removeprefix(prefix) for n in self.store.objects]
                      + [f"pending:{s.name.removeprefix(prefix)}" for s in self.store.pending.values()])

    def leave_dead_writer(self, path: str) -> None:
        mem = self.store
        mem.process += 1  # another writer than this test's
        crashed = mem.create(path)
        assert isinstance(crashed, MemSink)
        mem.faults.crash = ("write", mem.calls.get("write", 0) + 1)
        with pytest.raises(Crash):
            crashed.write_at(memoryview(b"x"), 0)
        mem.restart()  # a new process: the crashed writer's upload is left pending


def mem_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    return MemPlace(request.getfixturevalue("mem"))


# --- S3, through the real ``rclone serve s3`` of tests/s3 (one server for the session) --------------


class S3Place(Place):
    """A fresh bucket; listings come in pages of two, so that every listing of more than two
    names goes through the pagination."""

    empty_folders, lock_refuses, begun_at = False, False, 5 * MiB

    def __init__(self, bucket: Any) -> None:
        self.name, self.bucket = "s3", bucket
        self.root, self.storage = bucket.url("test"), storage_for(bucket.url("test"))

    def _key(self, path: str) -> str:
        return path.removeprefix(f"s3://{self.bucket.name}/")

    def read_bytes(self, path: str) -> bytes:
        data: bytes = self.bucket.get(self._key(path))
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        self.bucket.put(self._key(path), data)

    def names(self) -> list[str]:
        keys = [k.removeprefix("test/") for k in self.bucket.keys("test/")]
        try:
            page = self.bucket.raw.list_multipart_uploads(Bucket=self.bucket.name, Prefix="test/")
        except self.bucket.raw.exceptions.NoSuchUpload:  # rclone's answer for a bucket that never had one
            page = {}
        return sorted(keys + [f"pending:{u['Key'].removeprefix('test/')}" for u in page.get("Uploads", ())])

    def leave_dead_writer(self, path: str) -> None:
        """An upload with a part, and the journal's note of a writer on this host that is gone."""
        from ckptstream._storage import s3journal

        raw, key = self.bucket.raw, self._key(path)
        upload_id = raw.create_multipart_upload(Bucket=self.bucket.name, Key=key)["UploadId"]
        raw.upload_part(Bucket=self.bucket.name, Key=key, UploadId=upload_id, PartNumber=2, Body=b"x")
        host, ns = socket.gethostname(), publish.pid_namespace()
        note = {"endpoint": self.bucket.server.endpoint, "bucket": self.bucket.name, "key": key,
                "upload_id": upload_id, "host": host, "ns": ns, "pid": DEAD_PID}
        os.makedirs(s3journal.directory(), exist_ok=True)
        name = f"{host}-{ns}-{DEAD_PID}-{s3journal._digest(self.bucket.name, key, upload_id)}"
        Path(s3journal.directory(), name).write_text(json.dumps(note))


_made: dict[str, tuple[Storage, Any]] = {}  # endpoint -> (storage, raw client): made once a session


def s3_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """A new bucket on the session's server (tests/s3/s3server.py), whose ``s3://`` URLs reach a
    storage of its own, registered for the test as a third party's is (``register``): its client
    and the raw one are made once a session, as making a boto3 client costs about a second."""
    from ckptstream._storage import register
    from ckptstream._storage.s3 import S3Client, S3Storage
    from tests.s3.s3util import Bucket, raw_client

    server = request.getfixturevalue("s3_server")
    if server.endpoint not in _made:
        env = server.env
        _made[server.endpoint] = (S3Storage(endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]), raw_client(env))
    storage, raw = _made[server.endpoint]
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the upload journal: the test's own
    monkeypatch.setattr(S3Client, "page", 2)
    register("s3", lambda: storage)
    request.addfinalizer(lambda: register("s3", None))  # the built-in S3 storage again
    bucket = Bucket(server, f"ckpt-{uuid.uuid4().hex[:16]}", raw)
    raw.create_bucket(Bucket=bucket.name)
    return S3Place(bucket)


# --- the table --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """A storage the contract runs on: ``make`` gives each test a fresh ``Place`` of it;
    ``differs`` names the tests of a promise the storage is known not to keep, with the reason
    (each runs as a strict xfail: it shows in every run, and fails once the storage keeps it);
    ``cannot`` the tests (a regular expression of the test's id) that ask what the storage
    refuses by design (S3's least part), skipped with the reason."""

    name: str
    make: Callable[[pytest.FixtureRequest, Path], Place]
    marks: Sequence[pytest.MarkDecorator] = ()
    differs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cannot: Mapping[str, str] = dataclasses.field(default_factory=dict)


TARGETS = [
    Target("local", local_place),
    Target("mem", mem_place),
    Target("s3", s3_place,
        cannot={r"test_edge_case_tensors_round_trip\[.*-(513|4096)\]|test_a_failed_save_does_not_count\[s3\]":
                "buffers below S3's least part (5 MiB) are refused, with a clear error (check_part_size)"}),
]


def params() -> list[Any]:
    """The targets as parameters of a fixture, with their names as ids."""
    return [pytest.param(t, id=t.name, marks=t.marks) for t in TARGETS]


def mark_differences(item: pytest.Item) -> None:
    """A test of a promise its target is known not to keep (``Target.differs``): a strict xfail;
    one of what it refuses by design (``Target.cannot``): skipped."""
    callspec = getattr(item, "callspec", None)
    target = callspec.params.get("place") if callspec is not None else None
    name = getattr(item, "originalname", item.name)
    if not isinstance(target, Target):
        return
    if name in target.differs:
        item.add_marker(pytest.mark.xfail(reason=f"{target.name}: {target.differs[name]}", strict=True))
    for pattern, reason in target.cannot.items():
        if re.fullmatch(pattern, item.name):
            item.add_marker(pytest.mark.skip(reason=f"{target.name}: {reason}"))
