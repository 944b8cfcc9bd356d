"""The storages every contract test runs on: one entry of ``TARGETS`` each (a name and a factory
that gives a test a fresh, empty ``Place`` there). A new storage proves itself by adding its
entry and passing the tests that take the ``storage`` or ``place`` fixture (tests/conftest.py):

    TARGETS = [..., Target("foo", foo_place)]   # foo_place(request, tmp_path) -> Place

A ``Place`` is a folder of the storage for one test, with ways to look at and spoil what is
stored behind the storage's back (raw bytes, leftovers of unfinished writes) and the two ways
the seam lets a storage differ (``empty_folders``, ``lock_refuses``: see ``Place``).

The entries: ``local`` (``tmp_path``), ``mem`` (tests/memstore.py), and the object stores, each a
fresh bucket or container on the one real server of its suite for the session: ``s3`` (the
``rclone serve s3`` of tests/s3), ``gcs`` (the gcp-storage-emulator of tests/gcs), ``azure``
(the Azurite of tests/azure).
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import json
import os
import re
import socket
import struct
import time
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


class BucketPlace(Place):
    """A fresh bucket (or container) of an object store under ``test/``, its bytes read and
    written behind the storage's back through the tests' raw client (``get``, ``put``)."""

    scheme: str
    empty_folders, lock_refuses = False, False

    def __init__(self, name: str, bucket: Any) -> None:
        self.name, self.bucket = name, bucket
        self.root, self.storage = bucket.url("test"), storage_for(bucket.url("test"))

    def _key(self, path: str) -> str:
        return path.removeprefix(f"{self.scheme}://{self.bucket.name}/")

    def read_bytes(self, path: str) -> bytes:
        data: bytes = self.bucket.get(self._key(path))
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        self.bucket.put(self._key(path), data)


class S3Place(BucketPlace):
    """A fresh bucket; listings come in pages of two, so that every listing of more than two
    names goes through the pagination."""

    scheme, begun_at = "s3", 5 * MiB

    def names(self) -> list[str]:
        keys = [k.removeprefix("test/") for k in self.bucket.keys("test/")]
        try:
            page = self.bucket.raw.list_multipart_uploads(Bucket=self.bucket.name, Prefix="test/")
        except self.bucket.raw.exceptions.NoSuchUpload:  # rclone's answer for a bucket that never had one
            page = {}
        return sorted(keys + [f"pending:{u['Key'].removeprefix('test/')}" for u in page.get("Uploads", ())])

    def leave_dead_writer(self, path: str) -> None:
        """An upload with a part, and the journal's note of a writer on this host that is gone."""
        raw, key = self.bucket.raw, self._key(path)
        upload_id = raw.create_multipart_upload(Bucket=self.bucket.name, Key=key)["UploadId"]
        raw.upload_part(Bucket=self.bucket.name, Key=key, UploadId=upload_id, PartNumber=2, Body=b"x")
        note_dead_writer(self.bucket.server.endpoint, self.bucket.name, key, upload_id)


def note_dead_writer(endpoint: str, bucket: str, key: str, upload_id: str) -> None:
    """The upload journal's note (src/ckptstream/_storage/s3journal.py, shared by the object
    stores) of a writer of the upload on this host, in this PID namespace, that is gone."""
    from ckptstream._storage import s3journal

    host, ns = socket.gethostname(), publish.pid_namespace()
    note = {"endpoint": endpoint, "bucket": bucket, "key": key, "upload_id": upload_id, "host": host, "ns": ns,
            "pid": DEAD_PID}
    os.makedirs(s3journal.directory(), exist_ok=True)
    name = f"{host}-{ns}-{DEAD_PID}-{s3journal._digest(bucket, key, upload_id)}"
    Path(s3journal.directory(), name).write_text(json.dumps(note))


# endpoint (after "gs " or "az " for those stores) -> (storage, raw client): made once a session
_made: dict[str, tuple[Storage, Any]] = {}


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
    return S3Place("s3", bucket)


# --- GCS, through the real gcp-storage-emulator of tests/gcs (one emulator for the session) -------------


class GCSPlace(BucketPlace):
    """A fresh bucket; an upload in flight is its parts, objects of their own under a hidden
    prefix (``.ckptstream-uploads/KEY/UPLOAD/NNNNN``: src/ckptstream/_storage/gcs.py). The
    emulator answers every listing in one page, whatever page size is asked for."""

    scheme, begun_at = "gs", 5 * MiB

    def names(self) -> list[str]:
        from ckptstream._storage.gcs import HIDDEN

        uploads = {tuple(p[len(HIDDEN) :].rsplit("/", 2)[:2]) for p in self.bucket.parts("test/")}
        return sorted([k.removeprefix("test/") for k in self.bucket.keys("test/")]
                      + [f"pending:{key.removeprefix('test/')}" for key, _ in uploads])

    def leave_dead_writer(self, path: str) -> None:
        """An upload with a part (its id as the adapter makes one: its start in microseconds
        first), and the journal's note of a writer on this host that is gone."""
        from ckptstream._storage.gcs import HIDDEN

        key, upload_id = self._key(path), f"{time.time_ns() // 1000}-{uuid.uuid4().hex[:12]}"
        self.bucket.put(f"{HIDDEN}{key}/{upload_id}/00002", b"x")
        note_dead_writer(self.bucket.server.endpoint, self.bucket.name, key, upload_id)


def gcs_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """A new bucket on the session's emulator (tests/gcs/gcsserver.py), whose ``gs://`` URLs
    reach a storage of its own, registered for the test (as S3's): it and the raw client are
    made once a session."""
    server = request.getfixturevalue("gcs_server")  # first: it skips where the emulator is not installed
    from google.auth.credentials import AnonymousCredentials

    from ckptstream._storage import register
    from ckptstream._storage.gcs import GCSStorage
    from tests.gcs.gcsutil import new_bucket, raw_client

    made = f"gs {server.endpoint}"
    if made not in _made:
        env = server.env
        _made[made] = (GCSStorage(project=env["GOOGLE_CLOUD_PROJECT"], credentials=AnonymousCredentials(),
                                  client_options={"api_endpoint": env["STORAGE_EMULATOR_HOST"]}), raw_client(env))
    storage, raw = _made[made]
    request.getfixturevalue("monkeypatch").setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the upload journal
    register("gs", lambda: storage)
    request.addfinalizer(lambda: register("gs", None))
    return GCSPlace("gcs", new_bucket(server, raw))


# --- Azure Blob Storage, through the real Azurite of tests/azure (one server for the session) ---------------


class AzurePlace(BucketPlace):
    """A fresh container, listed in pages of two names; an upload in flight is its blob's
    uncommitted blocks, each id leading with the upload's (src/ckptstream/_storage/azure.py). A
    write begins an upload past the least block the adapter holds back (1 MiB)."""

    scheme, begun_at = "az", 1 * MiB

    def names(self) -> list[str]:
        """The committed blobs, and an upload per upload id among each blob's uncommitted blocks
        (a blob with none committed is listed only when asked to include uncommitted ones)."""
        listed = self.bucket.raw.list_blobs(name_starts_with="test/", include=["uncommittedblobs"])
        uploads = {(b.name, base64.b64decode(block).decode().rpartition("-")[0])
                   for b in listed for block in self.bucket.uncommitted(b.name)}
        return sorted([k.removeprefix("test/") for k in self.bucket.keys("test/")]
                      + [f"pending:{key.removeprefix('test/')}" for key, _ in uploads])

    def leave_dead_writer(self, path: str) -> None:
        """A staged block of an upload (its id as the adapter makes one), and the journal's note
        of a writer on this host that is gone (which ``remove_temps`` has no upload to match
        with: see the target's ``differs``)."""
        from ckptstream._storage.azure import block_id

        key, upload_id = self._key(path), uuid.uuid4().hex[:20]
        self.bucket.raw.get_blob_client(key).stage_block(block_id(upload_id, 2), b"x")
        note_dead_writer(self.bucket.server.endpoint, self.bucket.name, key, upload_id)


def azure_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """A new container on the session's Azurite (tests/azure/azurite.py), whose ``az://`` URLs
    reach a storage of its own, registered for the test (as S3's): it and the raw client are
    made once a session."""
    from ckptstream._storage import register
    from ckptstream._storage.azure import AzureClient, AzureStorage
    from tests.azure.azutil import Container

    server = request.getfixturevalue("azure_server")
    made = f"az {server.endpoint}"
    if made not in _made:
        _made[made] = (AzureStorage(connection_string=server.connection_string), server.raw())
    storage, raw = _made[made]
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the upload journal
    monkeypatch.setattr(AzureClient, "page", 2)
    register("az", lambda: storage)
    request.addfinalizer(lambda: register("az", None))
    name = f"ckpt-{uuid.uuid4().hex[:16]}"
    return AzurePlace("azure", Container(server, name, raw.create_container(name)))


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
    Target("gcs", gcs_place,
        cannot={r"test_edge_case_tensors_round_trip\[.*-(513|4096)\]|test_a_failed_save_does_not_count\[gcs\]":
                "buffers below GCS's least part (5 MiB, as S3's) are refused, with a clear error (check_part_size)"}),
    Target("azure", azure_place, differs=dict.fromkeys(
        ("test_an_abandoned_or_published_sink_leaves_nothing_behind", "test_leftovers_of_dead_writers_are_removed",
         "test_a_live_writers_leftovers_go_when_asked_for_all", "test_unfinished_writes_are_no_entries"),
        "an upload in flight is its blob's staged blocks, which Azure lists as no upload and lets nobody remove: "
        "unfinished names none and remove_temps aborts none; a blob's next commit, or Azure a week later, "
        "discards them (src/ckptstream/_storage/azure.py)"),
        cannot={r"test_edge_case_tensors_round_trip\[.*-(513|4096)\]|test_a_failed_save_does_not_count\[azure\]":
                "buffers below the adapter's least block (1 MiB) are refused, with a clear error (check_part_size)"}),
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
