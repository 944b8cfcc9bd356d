"""An object replaced while it is being read, on a real S3 server that ignores If-Match (rclone):
a load, load_into (CPU, and CUDA on a GPU machine) or verify reads it again once from a new
opening and returns the new state exactly, or, where that races a replace too, raises
ObjectReplacedError; never a checksum error ("corrupt"). The replace is a PUT of the raw client
right after ckptstream's opening."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._storage import s3
from tests.helpers import random_tensor
from tests.s3.s3util import Bucket, MiB, s3_server  # noqa: F401
from tests.s3.s3util import s3 as bucket  # noqa: F401

KEY = "run/state.safetensors"


def state(size: int) -> dict[str, Any]:
    # past the opening's first MiB: the data is read by GETs of their own
    return {"w": random_tensor((size,)), "b": random_tensor((333,)).to(torch.bfloat16), "step": size}



def object_of(bucket: Bucket, value: dict[str, Any], key: str, note: str = "") -> bytes:
    ckptstream.save(value, bucket.url(key), metadata={"note": note})
    return bucket.get(key)


def replace_after_opening(monkeypatch: pytest.MonkeyPatch, bucket: Bucket, versions: list[bytes]) -> list[int]:
    """After each of the next ``len(versions)`` openings of KEY, the raw client PUTs the next
    version over it; returns the openings' count so far (one item, updated)."""
    opened = [0]
    original: Callable[[s3.S3Source, Any], tuple[int, str | None]] = s3.S3Source._open

    def opening(source: s3.S3Source, deadline: Any) -> tuple[int, str | None]:
        found = original(source, deadline)
        if source.url.key == KEY:
            if opened[0] < len(versions):
                bucket.put(KEY, versions[opened[0]])
            opened[0] += 1
        return found

    monkeypatch.setattr(s3.S3Source, "_open", opening)
    return opened


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


@pytest.mark.parametrize("note", ["", "n" * 5000], ids=["same size", "another size"])
@pytest.mark.parametrize("call", ["load", "load_into", "verify"])
def test_a_replace_while_reading_reads_the_new_object_whole(bucket: Bucket, monkeypatch: pytest.MonkeyPatch,
                                                            call: str, note: str, device: torch.device) -> None:
    """The new object holds other values of the same tensors, and a header as long or longer (a
    longer note in its metadata)."""
    old, new = state(600_000), state(600_000)
    url = bucket.url(KEY)
    old_bytes, new_bytes = object_of(bucket, old, KEY), object_of(bucket, new, "run/new.safetensors", note)
    assert (len(new_bytes) == len(old_bytes)) == (not note)
    bucket.put(KEY, old_bytes)
    opened = replace_after_opening(monkeypatch, bucket, [new_bytes])
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in new.items()}
    if call == "load":
        assert same(ckptstream.load(url, device=device), on)
    elif call == "load_into":
        into = {"w": torch.zeros(600_000, device=device), "b": torch.zeros(333, dtype=torch.bfloat16, device=device),
                "step": 0}
        back = ckptstream.load_into(into, url)
        assert same(back, on)
        assert same(into | {"step": 600_000}, on)  # in place
    else:
        ckptstream.verify(url)
    assert opened == [2]  # the first reading raced the replace; the second read the new object
    assert bucket.get(KEY) == new_bytes


@pytest.mark.parametrize("call", ["load", "load_into", "verify"])
def test_a_replace_racing_both_readings_is_said_so(bucket: Bucket, monkeypatch: pytest.MonkeyPatch,
                                                   call: str) -> None:
    url = bucket.url(KEY)
    first, second = state(600_000), state(600_000)
    first_bytes, second_bytes = object_of(bucket, first, KEY), object_of(bucket, second, "run/other.safetensors")
    bucket.put(KEY, first_bytes)
    opened = replace_after_opening(monkeypatch, bucket, [second_bytes, first_bytes])
    reads: dict[str, Callable[[], object]] = {
        "load": lambda: ckptstream.load(url),
        "load_into": lambda: ckptstream.load_into({"w": torch.zeros(600_000),
                                                   "b": torch.zeros(333, dtype=torch.bfloat16)}, url),
        "verify": lambda: ckptstream.verify(url)}
    with pytest.raises(ckptstream.ObjectReplacedError) as info:
        reads[call]()
    message = str(info.value)
    assert url in message, message
    assert "replaced while it was read" in message, message
    assert "again when read a second time from a new opening" in message, message
    assert isinstance(info.value, ckptstream.ObjectStoreError)
    assert not isinstance(info.value, ckptstream.CorruptCheckpointError)
    assert opened == [2]


def test_a_reader_whose_object_is_replaced_says_so(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lazy reader is the caller's opening: a read after a replace raises, naming the URL and
    both versions, and a new opening reads the new object."""
    old, new = state(600_000), state(650_000)
    url = bucket.url(KEY)
    old_bytes, new_bytes = object_of(bucket, old, KEY), object_of(bucket, new, "run/new.safetensors")
    bucket.put(KEY, old_bytes)
    with ckptstream.open(url) as reader:
        bucket.put(KEY, new_bytes)
        with pytest.raises(ckptstream.ObjectReplacedError) as info:
            reader.read("w")
        message = str(info.value)
        assert url in message, message
        assert f"opened: {len(old_bytes)} bytes, ETag " in message, message
        assert f"now: {len(new_bytes)} bytes, ETag " in message, message
    with ckptstream.open(url) as reader:
        assert torch.equal(reader.read("w"), new["w"])
