"""The object-store storage through the storage interface, against a real S3 server: objects
written as a checkpoint writer writes them (header, chunks on the grid from several threads,
header again), published whole or not at all; ranged reads; prefixes as folders."""

from __future__ import annotations

import errno
import http.client
import json
import os
import subprocess
import sys
from typing import Any

import crc32c
import pytest

import ckptstream
from ckptstream._settings import DirectIO
from ckptstream._storage import storage_for
from ckptstream._storage.s3 import FIRST, MIN_PART, _reader, crc32c_b64
from tests.helpers import child_env
from tests.s3.s3util import Bucket, MiB, boto, s3, s3_server, write_like_the_engine  # noqa: F401

STORE = storage_for("s3://any")


def random_data(n: int) -> bytes:
    return os.urandom(n)


@pytest.mark.parametrize(("buffer_size", "header", "total"), [
    (16 * MiB, 8192, 40 * MiB),  # head = header + the first data up to 5 MiB; part 2 the rest of the first cell
    (16 * MiB, 8192, 16 * MiB),  # ends on a part boundary
    (16 * MiB, 8192, 16 * MiB + 1),  # a last part of one byte
    (16 * MiB, 8192, 7 * MiB),  # ends inside part 2
    (5 * MiB, 4096, 12 * MiB + 12345),  # parts of S3's least size: the head is the whole first cell
    (16 * MiB, 7 * MiB, 40 * MiB),  # a header longer than the least head: the head grows to its cell
    (16 * MiB, 4096, 3 * MiB),  # within the head: one PUT, no multipart upload
])
def test_round_trip_on_the_part_grid(s3: Bucket, buffer_size: int, header: int, total: int) -> None:
    data = random_data(total)
    url = s3.url("run/obj.safetensors")
    with STORE.create(url) as sink:
        write_like_the_engine(sink, data, header, buffer_size)
    assert s3.get("run/obj.safetensors") == data
    assert s3.uploads() == []
    with STORE.open(url) as source:
        assert source.size() == total
        out = bytearray(total)
        assert source.read_into(memoryview(out), 0) == total
    assert bytes(out) == data


def test_nothing_visible_until_published(s3: Bucket) -> None:
    old = random_data(1000)
    s3.put("a/ckpt", old)
    data = random_data(30 * MiB)
    sink = STORE.create(s3.url("a/ckpt"))
    write_like_the_engine(sink, data, 4096, 8 * MiB)
    assert s3.get("a/ckpt") == old  # every data part is up: the old object is still the one
    assert s3.keys() == ["a/ckpt"]
    assert len(s3.uploads("a/ckpt")) == 1
    sink.publish()
    assert s3.get("a/ckpt") == data
    assert s3.uploads() == []


def test_publish_and_abandon_happen_once(s3: Bucket) -> None:
    sink = STORE.create(s3.url("k"))
    sink.write_at(memoryview(b"one"), 0)
    sink.publish()
    sink.publish()  # again: nothing
    sink.abandon()  # after publish: nothing
    assert s3.get("k") == b"one"
    with pytest.raises(ValueError, match="was published"):
        sink.write_at(memoryview(b"two"), 0)
    sink = STORE.create(s3.url("k"))
    sink.write_at(memoryview(b"two"), 0)
    sink.abandon()
    sink.abandon()  # twice: nothing
    with pytest.raises(ValueError, match="was abandoned"):
        sink.publish()
    assert s3.get("k") == b"one"


def test_abandon_aborts_the_upload(s3: Bucket) -> None:
    old = random_data(1000)
    s3.put("a/ckpt", old)

    def interrupted() -> None:
        with STORE.create(s3.url("a/ckpt")) as sink:
            write_like_the_engine(sink, random_data(20 * MiB), 4096, 5 * MiB)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert s3.get("a/ckpt") == old
    assert s3.keys() == ["a/ckpt"]
    assert s3.uploads() == []


def test_a_hole_in_the_writes_fails_the_publish(s3: Bucket) -> None:
    """A writer that left a chunk out: nothing is published, the upload is aborted."""
    old = random_data(1000)
    s3.put("a/ckpt", old)
    with pytest.raises(ckptstream.ObjectStoreError, match=r"hole.*s3://.*/a/ckpt"), \
            STORE.create(s3.url("a/ckpt")) as sink:
        write_like_the_engine(sink, random_data(30 * MiB), 4096, 5 * MiB, skip=2)
    assert s3.get("a/ckpt") == old
    assert s3.uploads() == []


def test_parts_carry_their_crc32c(s3: Bucket) -> None:
    """Every part goes up with its CRC-32C (x-amz-checksum-crc32c), which the store checks."""
    data = random_data(40 * MiB)
    sent: dict[int, str] = {}

    def note(request: object, **kwargs: object) -> None:
        number = int(request.url.split("partNumber=")[1].split("&")[0])  # type: ignore[attr-defined]
        sent[number] = request.headers["x-amz-checksum-crc32c"].decode()  # type: ignore[attr-defined]

    boto().meta.events.register("before-send.s3.UploadPart", note)
    with STORE.create(s3.url("c")) as sink:
        write_like_the_engine(sink, data, 4096, 16 * MiB)
    assert sent == {1: crc32c_b64(data[:MIN_PART]), 2: crc32c_b64(data[MIN_PART : 16 * MiB]),
                    3: crc32c_b64(data[16 * MiB : 32 * MiB]), 4: crc32c_b64(data[32 * MiB :])}
    assert s3.get("c") == data


def test_ranged_reads(s3: Bucket) -> None:
    data = random_data(3 * MiB + 17)
    s3.put("r", data)
    with STORE.open(s3.url("r")) as source:
        assert source.grid(MiB, DirectIO.AUTO) == 1
        for offset, length in [(0, 1), (1, 4095), (MiB - 3, MiB + 7), (len(data) - 10, 10), (123456, 2 * MiB)]:
            out = bytearray(b"\xab" * length)
            assert source.read_into(memoryview(out), offset) == length
            assert bytes(out) == data[offset : offset + length]
        tail = bytearray(b"\xab" * 100)  # past the end: the bytes there are, and how many
        assert source.read_into(memoryview(tail), len(data) - 40) == 40
        assert bytes(tail[:40]) == data[-40:]
        assert set(tail[40:]) == {0xAB}
        assert source.read_into(memoryview(bytearray(8)), len(data)) == 0
        views = [memoryview(bytearray(n)) for n in (7, 0, MiB, 5)]  # one GET, streamed into each in turn
        assert source.readv_into(views, 99) == 7 + MiB + 5
        assert b"".join(bytes(v) for v in views) == data[99 : 99 + 7 + MiB + 5]


def requests_sent() -> list[str]:
    """Each request the library's client sends from now on: its operation, and its Range if any."""
    sent: list[str] = []

    def note(request: Any, event_name: str, **kw: Any) -> None:
        sent.append(" ".join([event_name.rsplit(".", 1)[1], *([request.headers["Range"].decode()]
                                                              if "Range" in request.headers else [])]))

    boto().meta.events.register("before-send.s3", note)
    return sent


@pytest.mark.parametrize("size", [0, 4096, FIRST - 1, FIRST, FIRST + 1, 3 * MiB])
def test_opening_is_one_get_that_serves_the_first_reads(s3: Bucket, size: int) -> None:
    """Opening asks for the first MiB (size and ETag come with it); reads within it need no
    request of their own, reads past it one ranged GET each; an empty object is looked at with
    a HEAD (it has no byte range)."""
    data = random_data(size)
    s3.put("r", data)
    sent = requests_sent()
    with STORE.open(s3.url("r")) as source:
        assert source.size() == size
        assert sent == ([f"GetObject bytes=0-{FIRST - 1}", "HeadObject"] if size == 0 else
                        [f"GetObject bytes=0-{FIRST - 1}"])
        sent.clear()
        if size == 0:
            assert source.read_into(memoryview(bytearray(8)), 0) == 0
            assert sent == []
            return
        head = bytearray(b"\xab" * 8)  # as a reader reads: the header's length, then the header
        assert source.read_into(memoryview(head), 0) == 8
        rest = [memoryview(bytearray(b"\xab" * n)) for n in (3, min(size, FIRST) - 11)]
        assert source.readv_into(rest, 8) == min(size, FIRST) - 8
        assert bytes(head) + b"".join(bytes(v) for v in rest) == data[:FIRST]
        assert sent == []  # the first MiB came with the opening
        if size > FIRST:
            out = bytearray(size - 100)
            assert source.read_into(memoryview(out), 100) == size - 100  # the kept bytes are gone: asked again
            assert bytes(out) == data[100:]
            assert sent == [f"GetObject bytes=100-{size - 1}"]


def test_bodies_are_read_in_place(s3: Bucket) -> None:
    """A GET's body goes straight into the buffer (http.client's readinto), not through a bytes
    object: with the client libraries of this environment the fast path is the one taken."""
    s3.put("r", b"0123456789")
    body = boto().get_object(Bucket=s3.name, Key="r", Range="bytes=2-5")["Body"]
    readinto, done = _reader(body)
    out = bytearray(4)
    assert readinto.__self__.__class__ is http.client.HTTPResponse  # type: ignore[attr-defined]
    assert readinto(memoryview(out)) == 4
    assert out == b"2345"
    done(True)


def test_folders(s3: Bucket) -> None:
    for key in ("run/step-1/DONE", "run/step-1/state", "run/step-2/state", "run/notes", "runaway"):
        s3.put(key, key.encode())
    assert [(e.name, e.kind) for e in STORE.list_folder(s3.url("run"))] == [
        ("notes", "file"), ("step-1", "folder"), ("step-2", "folder")]
    assert [e.name for e in STORE.list_folder(s3.url("run/step-1/"))] == ["DONE", "state"]
    assert STORE.list_folder(s3.url("nothing")) == []  # made or not: nothing lies under it
    assert STORE.exists(s3.url("run/step-1"))
    assert STORE.exists(s3.url("run/notes"))
    assert not STORE.exists(s3.url("run/step-3"))
    assert not STORE.exists(s3.url("ru"))
    assert STORE.size(s3.url("run/notes")) == len(b"run/notes")
    assert STORE.read_small(s3.url("run/step-1/DONE"), 100) == b"run/step-1/DONE"
    with pytest.raises(OSError, match="more than the 3 expected"):
        STORE.read_small(s3.url("run/notes"), 3)
    STORE.write_small(s3.url("run/step-2/DONE"), b"{}")
    assert s3.get("run/step-2/DONE") == b"{}"
    STORE.remove(s3.url("run/notes"))
    with pytest.raises(FileNotFoundError, match="run/notes"):
        STORE.remove(s3.url("run/notes"))
    STORE.remove(s3.url("run/notes"), missing_ok=True)
    STORE.make_folders(s3.url("run/step-3"))
    STORE.sync_folder(s3.url("run"))
    with pytest.raises(IsADirectoryError):
        STORE.open(s3.url("run/step-1"))
    with pytest.raises(IsADirectoryError):
        STORE.create(s3.url("run/step-1/"))
    with pytest.raises(IsADirectoryError, match="is a folder"):
        STORE.create(s3.url("run/step-1"))  # objects lie under it


def test_kinds_empty_folders_and_the_writer_lock(s3: Bucket) -> None:
    """What the manager asks beyond files: kinds (an empty prefix is none), a folder removed only
    once nothing lies under it, and a writer lock that holds nothing (S3 has no lock that a dead
    holder releases: said in S3Storage.lock)."""
    s3.put("run/step-1/DONE", b"{}")
    assert [STORE.kind(s3.url(k)) for k in ("run", "run/step-1", "run/step-1/DONE", "run/step-2")] == [
        "folder", "folder", "file", None]
    with pytest.raises(OSError, match="run/step-1") as info:
        STORE.remove_folder(s3.url("run/step-1"))
    assert info.value.errno == errno.ENOTEMPTY
    assert s3.keys() == ["run/step-1/DONE"]
    STORE.remove(s3.url("run/step-1/DONE"))
    STORE.remove_folder(s3.url("run/step-1"))  # nothing lies under it: nothing to do
    assert STORE.kind(s3.url("run/step-1")) is None
    first = STORE.lock(s3.url("run/.lock-rank-00000"), b"one")
    second = STORE.lock(s3.url("run/.lock-rank-00000"), b"two")  # not refused
    first.close()
    second.close()
    assert s3.keys() == []  # and nothing written


def test_remove_tree_takes_objects_and_open_uploads(s3: Bucket) -> None:
    for i in range(3):
        s3.put(f"run/step-1/f{i}", b"x")
    s3.put("run/step-10", b"kept")  # shares the prefix's letters, not its folder
    s3.raw.create_multipart_upload(Bucket=s3.name, Key="run/step-1/state")
    s3.raw.create_multipart_upload(Bucket=s3.name, Key="run/step-1/deeper/x")
    assert STORE.unfinished(s3.url("run/step-1")) == ["state"]  # the folder's own names, uploads only
    assert STORE.unfinished(s3.url("run")) == []
    STORE.remove_tree(s3.url("run/step-1"))
    assert STORE.unfinished(s3.url("run/step-1")) == []
    assert s3.keys() == ["run/step-10"]
    assert s3.uploads() == []
    STORE.remove_tree(s3.url("run/step-1"))  # nothing there: nothing happens


def test_part_size_and_direct_io_are_checked(s3: Bucket) -> None:
    with STORE.create(s3.url("k")) as sink:
        with pytest.raises(ValueError, match=r"s3://.*buffer_size.*5 MiB.*got 1048576"):
            sink.grid(MiB, DirectIO.AUTO)
        with pytest.raises(ValueError, match="direct_io='on' is for local files"):
            sink.grid(16 * MiB, DirectIO.ON)
        sink.write_at(memoryview(b"tiny"), 0)
    assert s3.get("k") == b"tiny"
    sink = STORE.create(s3.url("k"))
    sink.write_at(memoryview(bytes(4096)), 0)
    part = sink.grid(5 * MiB, DirectIO.AUTO)  # the head is the first part: part n starts at (n - 1) * part
    with pytest.raises(ValueError, match=r"offset 5242881 does not start a part.*sink's grid"):
        sink.write_at(memoryview(b"x"), part + 1)
    with pytest.raises(ckptstream.ObjectStoreError, match=r"more than 10000 parts.*at least 5243405"):
        sink.write_at(memoryview(b"x"), 10_000 * part)  # part 10001
    sink.abandon()
    assert s3.get("k") == b"tiny"
    assert s3.uploads() == []


def test_import_ckptstream_imports_no_client() -> None:
    code = "import sys, ckptstream; assert not {'boto3', 'botocore'} & set(sys.modules), 'a client was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": "src"})


def test_memory_of_a_256_mib_upload_is_the_head_and_a_small_bound(s3: Bucket) -> None:
    """Parts go up from the staging buffers themselves: a 256 MiB object written from 8 x 16 MiB
    buffers grows the writer's RSS by the held-back head and a few MiB of client state, not by
    a copy of any part (one copy per part in flight would be +128 MiB)."""
    here = os.path.dirname(__file__)
    env = child_env()
    out = subprocess.run([sys.executable, os.path.join(here, "child_sink_memory.py"), s3.url("big"), "256"],
                         env=env, capture_output=True, text=True, check=True).stdout
    figures = json.loads(out)
    obj = s3.get("big")
    assert len(obj) == 256 * MiB
    assert crc32c.crc32c(obj) == figures["crc"]
    assert figures["growth"] <= MIN_PART + 24 * MiB, figures


def test_without_boto3_an_s3_url_says_what_to_install() -> None:
    code = ("import sys; sys.modules['boto3'] = None\n"  # as if not installed: importing it raises ImportError
            "import ckptstream, torch\n"
            "try:\n"
            "    ckptstream.save({'w': torch.ones(2)}, 's3://bucket/k')\n"
            "except ckptstream.UnsupportedStorageError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": "src"}).stdout
    assert "s3://bucket/k" in out
    assert "pip install 'ckptstream[s3]'" in out


def test_two_storages_reach_two_endpoints_in_one_process(s3: Bucket) -> None:
    """Each storage has its own client: a second server, registered under a scheme of its own with
    its endpoint and keys, holds what was written there, and ``s3://`` (the environment's server)
    holds what was written there, both under the same bucket and key."""
    from ckptstream._storage import register, storage_for
    from ckptstream._storage.s3 import S3Storage
    from tests.s3.s3server import S3Server
    from tests.s3.s3util import raw_client

    other = S3Server()
    try:
        env = other.env
        raw_client(env).create_bucket(Bucket=s3.name)
        register("s3b", lambda: S3Storage("s3b", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]))
        here, there = os.urandom(7 * MiB + 3), os.urandom(6 * MiB + 5)
        for url, data in ((s3.url("k"), here), (f"s3b://{s3.name}/k", there)):
            with storage_for(url).create(url) as sink:
                write_like_the_engine(sink, data, 4096, 5 * MiB)
        assert s3.get("k") == here
        assert raw_client(env).get_object(Bucket=s3.name, Key="k")["Body"].read() == there
        for url, data in ((s3.url("k"), here), (f"s3b://{s3.name}/k", there)):
            with storage_for(url).open(url) as source:
                out = bytearray(len(data))
                assert source.read_into(memoryview(out), 0) == len(data)
                assert out == data
    finally:
        register("s3b", None)
        other.stop()
