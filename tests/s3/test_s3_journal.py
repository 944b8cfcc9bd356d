"""The upload journal keeps a note only while its upload may be left over: a completed or
aborted upload leaves neither a note nor a place in this process's live set, and a note whose
upload is gone (aborted elsewhere, or with its folder) is dropped by the next writer of its key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckptstream
from ckptstream._storage import s3journal, storage_for
from ckptstream._storage.objupload import MultipartSink
from tests.s3.faultproxy import FaultProxy
from tests.s3.s3util import Bucket, MiB, s3, s3_server, use_server, write_like_the_engine  # noqa: F401

STORE = storage_for("s3://any")


def notes() -> list[str]:
    return sorted(os.listdir(s3journal.directory())) if os.path.isdir(s3journal.directory()) else []


@pytest.mark.parametrize("end", ["publish", "abandon"])
def test_a_finished_upload_leaves_no_note_and_is_not_live(s3: Bucket, end: str) -> None:
    data = os.urandom(12 * MiB)
    sink = STORE.create(s3.url("a/ckpt"))
    write_like_the_engine(sink, data, 4096, 5 * MiB)
    (upload,) = s3.uploads()
    assert len(notes()) == 1
    assert upload in MultipartSink.live_uploads()
    getattr(sink, end)()
    assert s3.uploads() == []
    assert notes() == []
    assert upload not in MultipartSink.live_uploads()
    assert s3.keys() == (["a/ckpt"] if end == "publish" else [])


def abandon_unreachable(s3: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: str) -> str:
    """An upload of this process abandoned while the store could not be reached: it stays, and
    so does its note; returns its id."""
    host, port = s3.server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), cut_after=7 * MiB)
    try:
        use_server(monkeypatch, tmp_path, {**s3.server.env, "AWS_ENDPOINT_URL": proxy.endpoint,
                                           "AWS_MAX_ATTEMPTS": "1"})
        # the cut shows as a lost connection, or as the server's answer to the body it cut short
        with pytest.raises(ckptstream.ObjectStoreError), STORE.create(s3.url(key)) as sink:
            write_like_the_engine(sink, os.urandom(24 * MiB), 4096, 5 * MiB)
    finally:
        proxy.close()
    use_server(monkeypatch, tmp_path, s3.server.env)  # the link is back
    (upload,) = s3.uploads(key)
    assert len(notes()) == 1
    assert upload not in MultipartSink.live_uploads()
    return upload


def test_a_note_whose_upload_is_gone_goes_with_the_next_save(s3: Bucket, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    upload = abandon_unreachable(s3, monkeypatch, tmp_path, "a/ckpt")
    s3.raw.abort_multipart_upload(Bucket=s3.name, Key="a/ckpt", UploadId=upload)  # as a lifecycle rule would
    assert len(notes()) == 1
    data = os.urandom(6 * MiB)
    with STORE.create(s3.url("a/ckpt")) as sink:
        assert notes() == []
        write_like_the_engine(sink, data, 4096, 5 * MiB)
    assert s3.get("a/ckpt") == data
    assert notes() == []


def test_removing_a_folder_drops_the_notes_of_the_uploads_it_aborts(s3: Bucket, monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    abandon_unreachable(s3, monkeypatch, tmp_path, "run/step-1/state")
    s3.put("run/step-1/DONE", b"{}")
    STORE.remove_tree(s3.url("run/step-1"))
    assert s3.keys() == []
    assert s3.uploads() == []
    assert notes() == []

