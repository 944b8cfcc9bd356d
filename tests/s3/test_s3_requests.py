"""What the requests themselves carry: every read after the opening asks for the opened version
(If-Match) and refuses another (its ETag), and listings follow their continuation through every
page (objects and incomplete uploads)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import ckptstream
from ckptstream._storage import s3 as s3_storage
from ckptstream._storage import storage_for
from ckptstream._storage.s3 import FIRST
from tests.s3.s3util import Bucket, MiB, boto, s3, s3_server  # noqa: F401

STORE = storage_for("s3://any")


def test_reads_ask_for_the_opened_version(s3: Bucket) -> None:
    data = os.urandom(3 * MiB)
    s3.put("r", data)
    asked: list[Any] = []
    boto().meta.events.register("before-send.s3.GetObject",
                                           lambda request, **kw: asked.append(request.headers.get("If-Match")))
    with STORE.open(s3.url("r")) as source:
        out = bytearray(len(data))
        assert source.read_into(memoryview(out), FIRST) == len(data) - FIRST
    assert out[: len(data) - FIRST] == data[FIRST:]
    etag = s3.raw.head_object(Bucket=s3.name, Key="r")["ETag"]
    assert asked[0] is None  # the opening: any version
    assert len(asked) == 2
    assert asked[1] is not None
    assert asked[1].decode() == etag


def test_an_object_replaced_after_opening_fails_the_read(s3: Bucket) -> None:
    """Not a mix of two versions: the store may ignore If-Match (rclone does), so the answer's
    ETag is compared with the opening's too."""
    old, new = os.urandom(3 * MiB), os.urandom(3 * MiB)
    s3.put("r", old)
    with STORE.open(s3.url("r")) as source:
        head = bytearray(FIRST)
        assert source.read_into(memoryview(head), 0) == FIRST  # served by the opening
        s3.put("r", new)  # behind the reader's back
        rest = bytearray(len(old) - FIRST)
        with pytest.raises(ckptstream.ObjectStoreError, match=r"replaced while it was read.*open it again") as info:
            source.read_into(memoryview(rest), FIRST)
    assert info.value.code == "PreconditionFailed"
    assert info.value.url == s3.url("r")
    assert head == old[:FIRST]
    assert rest != new[FIRST:]  # nothing of the new version was taken
    assert s3.get("r") == new


def test_listings_follow_every_page(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_storage.S3Client, "page", 2)
    pages: list[str] = []
    for name in ("ListObjectsV2", "ListMultipartUploads"):
        boto().meta.events.register(f"before-send.s3.{name}", lambda name=name, **kw: pages.append(name))
    files = [f"f{i}" for i in range(7)]
    for name in files:
        s3.put(f"run/{name}", name.encode())
    for name in ("step-1", "step-2"):
        s3.put(f"run/{name}/DONE", b"{}")
    assert [e.name for e in STORE.list_folder(s3.url("run"))] == sorted([*files, "step-1", "step-2"])
    assert pages.count("ListObjectsV2") == 5  # 9 entries, 2 a page
    for i in range(5):
        s3.raw.create_multipart_upload(Bucket=s3.name, Key=f"run/u{i}")
    assert STORE.unfinished(s3.url("run")) == [f"u{i}" for i in range(5)]
    for _ in range(4):
        s3.raw.create_multipart_upload(Bucket=s3.name, Key="run/u1")
    of_u1 = s3.uploads("run/u1")
    assert len(of_u1) == 5
    assert sorted(STORE.remove_temps(s3.url("run/u1"), stale_only=False)) == sorted(of_u1)
    del pages[:]
    STORE.remove_tree(s3.url("run"))
    assert (pages.count("ListObjectsV2"), pages.count("ListMultipartUploads")) == (5, 2)  # 9 keys; 4 uploads
    assert s3.keys() == []
    assert s3.uploads() == []
