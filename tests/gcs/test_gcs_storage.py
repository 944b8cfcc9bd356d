"""The GCS storage through the storage interface, against gcp-storage-emulator: objects written
as a checkpoint writer writes them (header, chunks on the grid from several threads, header
again), parts as hidden objects composed into the key at the end (a tree past 32 parts), the
key changed whole or not at all; CRC-32Cs checked by the store; ranged reads; prefixes as
folders; typed errors naming the URL."""

from __future__ import annotations

import os

import pytest

import ckptstream
from ckptstream._storage import gcs as gcs_storage
from ckptstream._storage import storage_for
from ckptstream._storage.objclient import call, parse
from tests.gcs.gcsutil import Bucket, MiB, gcs, gcs_server, new_bucket  # noqa: F401
from tests.s3.s3util import write_like_the_engine

STORE = storage_for("gs://any")


def random_data(n: int) -> bytes:
    return os.urandom(n)


@pytest.mark.parametrize(("buffer_size", "header", "total"), [
    (16 * MiB, 8192, 40 * MiB),  # head = header + the first data up to 5 MiB; part 2 the rest of the first cell
    (16 * MiB, 8192, 16 * MiB),  # ends on a part boundary
    (16 * MiB, 8192, 16 * MiB + 1),  # a last part of one byte
    (5 * MiB, 4096, 12 * MiB + 12345),  # parts of the least size: the head is the whole first cell
    (16 * MiB, 7 * MiB, 40 * MiB),  # a header longer than the least head: the head grows to its cell
    (16 * MiB, 4096, 3 * MiB),  # within the head: one upload, no parts
])
def test_round_trip_on_the_part_grid(gcs: Bucket, buffer_size: int, header: int, total: int) -> None:
    data = random_data(total)
    url = gcs.url("run/obj.safetensors")
    with STORE.create(url) as sink:
        write_like_the_engine(sink, data, header, buffer_size)
    assert gcs.get("run/obj.safetensors") == data
    assert gcs.all_keys() == ["run/obj.safetensors"]  # the parts removed
    with STORE.open(url) as source:
        assert source.size() == total
        out = bytearray(total)
        assert source.read_into(memoryview(out), 0) == total
    assert bytes(out) == data


@pytest.mark.parametrize("most", [2, 3, 32])
def test_a_compose_tree_past_the_sources_per_request(gcs: Bucket, monkeypatch: pytest.MonkeyPatch, most: int) -> None:
    """More parts than one compose takes: intermediate objects, composed again (GCS takes 32
    sources a request; fewer here, so that a few parts make a tree of two or three levels)."""
    monkeypatch.setattr(gcs_storage, "COMPOSE_MAX", most)
    data = random_data(9 * 5 * MiB + 777)  # 10 parts
    with STORE.create(gcs.url("t")) as sink:
        write_like_the_engine(sink, data, 4096, 5 * MiB)
    assert gcs.get("t") == data
    assert gcs.all_keys() == ["t"]


def test_nothing_visible_until_published(gcs: Bucket) -> None:
    old = random_data(1000)
    gcs.put("a/ckpt", old)
    data = random_data(30 * MiB)
    sink = STORE.create(gcs.url("a/ckpt"))
    write_like_the_engine(sink, data, 4096, 8 * MiB)
    assert gcs.get("a/ckpt") == old  # every data part is up: the old object is still the one
    assert gcs.keys() == ["a/ckpt"]
    assert len(gcs.parts("a/ckpt")) == 3  # parts 2..4 (the head, the first 8 MiB cell, goes up last)
    assert [e.name for e in STORE.list_folder(gcs.url(""))] == ["a"]  # the hidden prefix is not listed
    assert STORE.unfinished(gcs.url("a")) == ["ckpt"]
    sink.publish()
    assert gcs.get("a/ckpt") == data
    assert gcs.parts() == []


def test_abandon_removes_the_parts(gcs: Bucket) -> None:
    old = random_data(1000)
    gcs.put("a/ckpt", old)

    def interrupted() -> None:
        with STORE.create(gcs.url("a/ckpt")) as sink:
            write_like_the_engine(sink, random_data(20 * MiB), 4096, 5 * MiB)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert gcs.get("a/ckpt") == old
    assert gcs.all_keys() == ["a/ckpt"]


def test_a_hole_in_the_writes_fails_the_publish(gcs: Bucket) -> None:
    old = random_data(1000)
    gcs.put("a/ckpt", old)
    with pytest.raises(ckptstream.ObjectStoreError, match=r"hole.*gs://.*/a/ckpt"), \
            STORE.create(gcs.url("a/ckpt")) as sink:
        write_like_the_engine(sink, random_data(30 * MiB), 4096, 5 * MiB, skip=2)
    assert gcs.get("a/ckpt") == old
    assert gcs.all_keys() == ["a/ckpt"]


def test_a_part_whose_bytes_do_not_match_its_crc32c_is_refused(gcs: Bucket) -> None:
    """Each upload carries its CRC-32C, which the store checks: bytes changed on the way are refused."""
    from ckptstream import _checksum

    client = STORE.client()  # type: ignore[attr-defined]
    url = parse(gcs.url("c"), "gs")
    data = memoryview(random_data(MiB))
    with pytest.raises(ckptstream.ObjectStoreError, match=r"400.*CRC32C.*gs://.*/c"):
        call(client, url, "writing", client.put, url, data, _checksum.crc_of(data) ^ 1)
    assert gcs.all_keys() == []
    client.put(url, data, _checksum.crc_of(data))
    assert gcs.get("c") == data
    upload = client.create_upload(url)  # a part: the store's answer tells (the emulator ignores X-Goog-Hash)
    with pytest.raises(ckptstream.ObjectStoreError, match=r"changed on the way"):
        call(client, url, "uploading a part", client.upload_part, url, upload, 2, data, _checksum.crc_of(data) ^ 1)
    client.abort_upload(url, upload)
    assert gcs.all_keys() == ["c"]


def test_a_compose_whose_parts_do_not_add_up_to_its_crc32c_is_refused(gcs: Bucket) -> None:
    """The composed object's CRC-32C is the parts' combined: a wrong one, and the key is not made."""
    from ckptstream import _checksum

    client = STORE.client()  # type: ignore[attr-defined]
    url = parse(gcs.url("k"), "gs")
    upload = client.create_upload(url)
    pieces = [memoryview(random_data(MiB)) for _ in range(3)]
    parts = [(n, client.upload_part(url, upload, n, p, _checksum.crc_of(p)), _checksum.crc_of(p))
             for n, p in enumerate(pieces, 1)]
    bad = [*parts[:2], (3, parts[2][1], parts[2][2] ^ 4)]
    with pytest.raises(Exception, match=r"(?i)crc32c"):
        client.complete_upload(url, upload, bad)
    assert gcs.keys() == []
    client.complete_upload(url, upload, parts)
    assert gcs.get("k") == b"".join(pieces)
    assert gcs.all_keys() == ["k"]


def test_ranged_reads(gcs: Bucket) -> None:
    data = random_data(3 * MiB + 5)
    gcs.put("r", data)
    with STORE.open(gcs.url("r")) as source:
        for offset, length in ((0, 10), (MiB - 3, 7), (2 * MiB, MiB), (len(data) - 40, 40)):
            out = bytearray(length)
            assert source.read_into(memoryview(out), offset) == length
            assert bytes(out) == data[offset : offset + length]
        assert source.read_into(memoryview(bytearray(8)), len(data)) == 0
        views = [memoryview(bytearray(n)) for n in (7, 0, MiB, 5)]  # one GET, streamed into each in turn
        assert source.readv_into(views, MiB + 1) == 7 + MiB + 5
        assert b"".join(bytes(v) for v in views) == data[MiB + 1 : 2 * MiB + 13]
    gcs.put("empty", b"")
    with STORE.open(gcs.url("empty")) as source:
        assert source.size() == 0


def test_prefixes_are_folders(gcs: Bucket) -> None:
    for key in ("run/a", "run/b", "run/sub/c", "runner/x"):
        gcs.put(key, key.encode())
    assert [(e.name, e.kind) for e in STORE.list_folder(gcs.url("run"))] == [
        ("a", "file"), ("b", "file"), ("sub", "folder")]
    assert STORE.kind(gcs.url("run")) == "folder"
    assert STORE.kind(gcs.url("run/a")) == "file"
    assert STORE.kind(gcs.url("nothing")) is None
    assert STORE.read_small(gcs.url("run/a"), 100) == b"run/a"
    with pytest.raises(IsADirectoryError):
        STORE.create(gcs.url("run"))
    STORE.remove(gcs.url("run/a"))
    with pytest.raises(FileNotFoundError, match="no such object"):
        STORE.remove(gcs.url("run/a"))
    STORE.remove(gcs.url("run/a"), missing_ok=True)
    sink = STORE.create(gcs.url("run/sub/open"))  # an upload in flight under the folder
    write_like_the_engine(sink, random_data(12 * MiB), 4096, 5 * MiB)
    STORE.remove_tree(gcs.url("run"))
    assert gcs.all_keys() == ["runner/x"]  # its parts too; nothing of a neighbour whose name it begins
    sink.abandon()


def test_a_dead_writers_parts_go_with_the_next_save(gcs: Bucket) -> None:
    """Parts of an upload no live writer of this host has, once older than STALE_AFTER, are
    removed by the next writer of the key (a killed writer's, by its journal: the kill tests)."""
    client = STORE.client()  # type: ignore[attr-defined]
    url = parse(gcs.url("k"), "gs")
    from ckptstream import _checksum

    old = client.create_upload(url).partition("-")[2]
    stale = f"1000000-{old}"  # begun in 1970: stale
    part = memoryview(random_data(100))
    client.upload_part(url, stale, 2, part, _checksum.crc_of(part))
    fresh = client.create_upload(url)
    client.upload_part(url, fresh, 2, part, _checksum.crc_of(part))
    assert len(gcs.parts("k")) == 2
    assert STORE.remove_temps(gcs.url("k")) == []  # the stale one's part was written now: not stale
    assert STORE.remove_temps(gcs.url("k"), stale_only=False) != []
    assert gcs.parts("k") == []


def test_errors_name_the_url(gcs: Bucket) -> None:
    with pytest.raises(ckptstream.BucketNotFoundError, match="gs://no-such-bucket-here/k"):
        STORE.create("gs://no-such-bucket-here/k")
    with pytest.raises(ckptstream.BucketNotFoundError, match="gs://no-such-bucket-here/k"):
        STORE.size("gs://no-such-bucket-here/k")
    with pytest.raises(ckptstream.ObjectNotFoundError, match=r"no such object.*gs://.*/absent"):
        STORE.open(gcs.url("absent"))
    with pytest.raises(ValueError, match="names no bucket"):
        STORE.open("gs:///k")


@pytest.mark.parametrize("size", [1000, 12 * MiB])  # one upload at publishing; parts as the grid's cells fill
def test_a_bucket_removed_under_a_writer_is_named(gcs: Bucket, size: int) -> None:
    """An upload's bare 404 (the emulator's, for a bucket removed after the sink was made) says
    that the bucket is missing, not an object."""
    other = new_bucket(gcs.server, gcs.raw)
    sink = STORE.create(other.url("k"))
    gcs.raw.bucket(other.name).delete()
    missing = f"'{other.name}' does not exist.*gs://{other.name}/k"
    with pytest.raises(ckptstream.BucketNotFoundError, match=missing), sink:
        write_like_the_engine(sink, random_data(size), 4096, 5 * MiB)  # (published at the block's end)


def test_a_replaced_object_fails_the_read(gcs: Bucket) -> None:
    """Every read after the opening asks for the generation opened (ifGenerationMatch) and checks
    the answer's; the emulator does neither, so the test is skipped where it cannot hold."""
    from ckptstream._storage.objsource import FIRST

    old, new = random_data(3 * MiB), random_data(3 * MiB)
    gcs.put("r", old)
    answer = STORE.client().get(parse(gcs.url("r"), "gs"), 0, 10, None)  # type: ignore[attr-defined]
    answer.done(False)
    if answer.etag is None:
        pytest.skip("gcp-storage-emulator sends no x-goog-generation with a download and ignores "
                    "ifGenerationMatch: a replaced object of the same size cannot be told apart there")
    with STORE.open(gcs.url("r")) as source:
        gcs.put("r", new)
        with pytest.raises(ckptstream.ObjectReplacedError):
            source.read_into(memoryview(bytearray(len(old) - FIRST)), FIRST)
