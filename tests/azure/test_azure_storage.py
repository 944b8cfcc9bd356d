"""The Azure adapter through the storage interface, against Azurite: blobs written as a
checkpoint writer writes them (header, blocks on the grid from several threads, header again),
committed whole or not at all; ranged reads; prefixes as folders; typed errors naming the URL."""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

import pytest

import ckptstream
from ckptstream._storage import azure as azure_module
from ckptstream._storage import register, storage_for
from ckptstream._storage.azure import MIN_PART, AzureStorage, block_id
from tests.azure.azutil import Container, MiB, azure, azure_server, reset_client  # noqa: F401
from tests.s3.s3util import write_like_the_engine

STORE = storage_for("az://any")


def committed(c: Container, key: str) -> list[tuple[str, int]]:
    blocks, _ = c.raw.get_blob_client(key).get_block_list("committed")
    return [(base64.b64decode(b.id).decode(), b.size) for b in blocks]


@pytest.mark.parametrize(("buffer_size", "header", "total"), [
    (8 * MiB, 8192, 20 * MiB + 3),  # the held-back head, part 2 the rest of the first cell, a short last block
    (8 * MiB, 8192, 16 * MiB),  # ends on a block boundary
    (4 * MiB, 4096, 4 * MiB + 1),  # a last block of one byte
    (MIN_PART, 4096, 5 * MiB + 12345),  # blocks of the least size: the head is the whole first cell
    (8 * MiB, 3 * MiB, 20 * MiB),  # a header longer than the least head: the head grows to its cell
    (8 * MiB, 4096, MIN_PART // 2),  # within the head: one Put Blob, no blocks
])
def test_round_trip_on_the_block_grid(azure: Container, buffer_size: int, header: int, total: int) -> None:
    data = os.urandom(total)
    url = azure.url("run/obj.safetensors")
    with STORE.create(url) as sink:
        write_like_the_engine(sink, data, header, buffer_size)
    assert azure.get("run/obj.safetensors") == data
    blocks = committed(azure, "run/obj.safetensors")
    assert sum(size for _, size in blocks) == (total if total > MIN_PART else 0)  # a Put Blob lists no blocks
    assert [name.rsplit("-", 1)[1] for name, _ in blocks] == [f"{n:06d}" for n in range(1, len(blocks) + 1)]
    assert all(size == buffer_size for _, size in blocks[2:-1])
    assert azure.uncommitted("run/obj.safetensors") == []
    with STORE.open(url) as source:
        assert source.size() == total
        out = bytearray(total)
        assert source.read_into(memoryview(out), 0) == total
    assert bytes(out) == data


def test_nothing_visible_until_committed(azure: Container) -> None:
    old = os.urandom(1000)
    azure.put("a/ckpt", old)
    data = os.urandom(12 * MiB)
    sink = STORE.create(azure.url("a/ckpt"))
    write_like_the_engine(sink, data, 4096, 4 * MiB)
    assert azure.get("a/ckpt") == old  # every data block is staged: the old blob is still the one
    assert azure.keys() == ["a/ckpt"]
    assert len(azure.uncommitted("a/ckpt")) == 3  # blocks 2..4 (the head goes last)
    sink.publish()
    assert azure.get("a/ckpt") == data
    assert azure.uncommitted("a/ckpt") == []


def test_an_abandoned_uploads_blocks_stay_out_of_the_next_commit(azure: Container) -> None:
    """Azure cannot remove staged blocks: an abandoned (or killed) upload's stay uncommitted,
    unlisted, until the blob's next commit, which names only its own blocks and so discards them."""
    sink = STORE.create(azure.url("k"))
    write_like_the_engine(sink, os.urandom(10 * MiB), 4096, 4 * MiB)
    sink.abandon()
    assert azure.keys() == []
    assert len(azure.uncommitted("k")) == 3  # blocks 2..4 (the head goes last)
    data = os.urandom(9 * MiB)
    with STORE.create(azure.url("k")) as sink:
        write_like_the_engine(sink, data, 4096, 4 * MiB)
    assert azure.get("k") == data
    assert azure.uncommitted("k") == []
    assert sum(size for _, size in committed(azure, "k")) == len(data)


def test_two_writers_of_one_blob_the_first_commit_wins(azure: Container) -> None:
    """The first commit discards the other writer's staged blocks: that writer's commit fails,
    typed and naming the URL, and the blob stays the first writer's, whole."""
    a, b = os.urandom(9 * MiB), os.urandom(10 * MiB)
    first, second = STORE.create(azure.url("k")), STORE.create(azure.url("k"))
    write_like_the_engine(first, a, 4096, 4 * MiB)
    write_like_the_engine(second, b, 4096, 4 * MiB)
    first.publish()
    with pytest.raises(ckptstream.ObjectStoreError, match=r"InvalidBlockList.*az://.*/k"):
        second.publish()
    assert azure.get("k") == a


def test_block_ids_are_of_one_length() -> None:
    ids = {len(block_id(azure_module.AzureClient.create_upload(None, None), n))  # type: ignore[arg-type]
           for n in (1, 2, 10, 49_999)}
    assert len(ids) == 1


def test_blocks_carry_their_md5(azure: Container, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every staged block is sent with its MD5, which the service checks: a block whose bytes are
    not those the digest was taken of is refused, and nothing is made."""
    real = hashlib.md5

    def of_other_bytes(data: Any, **kw: Any) -> Any:
        return real(bytes(data)[:-1] + b"?", **kw)

    monkeypatch.setattr(hashlib, "md5", of_other_bytes)  # the module the adapter digests with
    sink = STORE.create(azure.url("k"))
    with pytest.raises(ckptstream.ObjectStoreError, match=r"Md5Mismatch.*az://.*/k") as caught:
        write_like_the_engine(sink, os.urandom(6 * MiB), 4096, 4 * MiB)
    assert caught.value.code == "Md5Mismatch"
    sink.abandon()
    assert azure.keys() == []


def test_ranged_reads_and_a_replaced_blob(azure: Container) -> None:
    data = os.urandom(3 * MiB + 7)
    azure.put("r", data)
    with STORE.open(azure.url("r")) as source:
        assert source.size() == len(data)
        a, b = bytearray(1000), bytearray(MiB)
        assert source.readv_into([memoryview(a), memoryview(b)], MiB + 5) == 1000 + MiB
        assert bytes(a + b) == data[MiB + 5 : 2 * MiB + 1005]
        tail = bytearray(100)
        assert source.read_into(memoryview(tail), len(data) - 7) == 7
        assert bytes(tail[:7]) == data[-7:]
        azure.put("r", os.urandom(len(data)))  # the same size, another ETag
        with pytest.raises(ckptstream.ObjectReplacedError, match=r"az://.*/r"):
            source.read_into(memoryview(bytearray(MiB)), 2 * MiB)
    azure.put("empty", b"")
    with STORE.open(azure.url("empty")) as source:
        assert source.size() == 0


def test_folders_listing_and_removal(azure: Container) -> None:
    for key in ("run/a", "run/sub/b", "run/sub/deep/c", "runner/x", "top"):
        azure.put(key, key.encode())
    assert [(e.name, e.kind) for e in STORE.list_folder(azure.url("run"))] == [("a", "file"), ("sub", "folder")]
    assert [(e.name, e.kind) for e in STORE.list_folder(azure.url())] == [
        ("run", "folder"), ("runner", "folder"), ("top", "file")]
    assert (STORE.kind(azure.url("run")), STORE.kind(azure.url("run/a")), STORE.kind(azure.url("nope"))) == (
        "folder", "file", None)
    assert STORE.size(azure.url("run/sub/b")) == len(b"run/sub/b")
    with pytest.raises(IsADirectoryError):
        STORE.create(azure.url("run/sub"))
    STORE.remove(azure.url("run/a"))
    with pytest.raises(FileNotFoundError, match=r"az://.*/run/a"):
        STORE.remove(azure.url("run/a"))
    STORE.remove(azure.url("run/a"), missing_ok=True)
    STORE.remove_tree(azure.url("run"))  # not "runner"
    assert azure.keys() == ["runner/x", "top"]


def test_listings_follow_every_page(azure: Container, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(7):
        azure.put(f"p/{i}", b"x")
        azure.put(f"p/d{i}/y", b"y")
    monkeypatch.setattr(azure_module.AzureClient, "page", 3)
    monkeypatch.setattr(azure_module.AzureClient, "delete_batch", 4)
    assert len(STORE.list_folder(azure.url("p"))) == 14
    STORE.remove_tree(azure.url("p"))
    assert azure.keys() == []


def test_small_reads_and_writes(azure: Container) -> None:
    STORE.write_small(azure.url("rec"), b"holder")
    assert STORE.read_small(azure.url("rec"), 100) == b"holder"
    with pytest.raises(OSError, match="more than the 3"):
        STORE.read_small(azure.url("rec"), 3)


def test_errors_are_typed_and_name_the_url(azure: Container, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ckptstream.BucketNotFoundError, match="az://no-such-container/k"):
        ckptstream.save({"x": ckptstream_tensor()}, "az://no-such-container/k")
    with pytest.raises(ckptstream.ObjectNotFoundError, match=r"az://.*/absent"):
        ckptstream.load(azure.url("absent"))
    with pytest.raises(ckptstream.BucketNotFoundError, match="az://no-such-container/k"):
        ckptstream.load("az://no-such-container/k")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure.server.connection_string.replace(
        "AccountKey=Eby8", "AccountKey=Xby8"))
    reset_client()
    with pytest.raises(ckptstream.AccessDeniedError, match=r"az://.*/k"):
        ckptstream.save({"x": ckptstream_tensor()}, azure.url("k"))
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    reset_client()
    with pytest.raises(ckptstream.NoCredentialsError, match=r"AZURE_STORAGE_CONNECTION_STRING.*az://.*/k"):
        ckptstream.load(azure.url("k"))


def ckptstream_tensor() -> Any:
    import torch

    return torch.randn(10)


def test_two_storages_reach_two_accounts_in_one_process(azure: Container) -> None:
    """A storage made with its own connection string reaches its account whatever the variables
    say: here a second scheme on the same emulator, with the variables pointing nowhere."""
    register("az2", lambda: AzureStorage("az2", connection_string=azure.server.connection_string))
    try:
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = "BlobEndpoint=http://127.0.0.1:9/none;AccountName=x;AccountKey=eA=="
        reset_client()
        data = os.urandom(100)
        storage_for("az2://x").write_small(f"az2://{azure.name}/two", data)
        assert azure.get("two") == data
        with ckptstream.settings(s3_timeout=2), pytest.raises(ckptstream.ConnectionLostError, match="az://"):
            storage_for("az://x").size(azure.url("two"))  # nothing listens there: the deadline ends the retries
    finally:
        register("az2", None)


def test_import_ckptstream_imports_no_azure_client() -> None:
    import subprocess
    import sys

    from tests.helpers import child_env

    code = "import sys, ckptstream; print('azure.storage.blob' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # only the first az:// URL imports it


def test_uncommitted_blocks_expire_after_seven_days() -> None:
    pytest.skip("Azure discards blocks never committed 7 days after they were staged; Azurite has no clock "
                "to move forward and a test cannot wait a week (the next commit's discarding is tested above)")


def test_throttling_is_a_typed_error() -> None:
    pytest.skip("Azurite never throttles (no 503 ServerBusy, no 500 OperationTimedOut): the mapping to "
                "ThrottledError is not tested against a real answer")


def test_without_azure_storage_blob_an_az_url_says_what_to_install() -> None:
    import subprocess
    import sys

    from tests.helpers import child_env

    code = ("import sys; sys.modules['azure.storage.blob'] = None\n"  # as if not installed
            "import ckptstream, torch\n"
            "try:\n"
            "    ckptstream.save({'w': torch.ones(2)}, 'az://container/k')\n"
            "except ckptstream.UnsupportedStorageError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                         check=True).stdout
    assert "az://container/k" in out
    assert "pip install 'ckptstream[azure]'" in out
