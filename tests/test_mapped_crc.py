"""The checksums of the mapped load: which tasks are brought in first, the caller's share of
them while the state is made, and a corrupt byte caught wherever it lies.

A task whose pages are in the page cache is read as it is (no populate call); one whose pages are
not is populated first. While the caller's thread makes the tensors it checksums a task now and
then, so the other threads get the GIL back for their next pieces; every byte is still checked
before ``load`` returns: a flipped byte at a tensor's first or last byte, at either side of a
piece boundary inside a large tensor, in the first tasks (taken while the state is made), and in
the last tensor of the file, fails the load with the tensor's name, whether the pages were
resident or not.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import CorruptCheckpointError, _checksum
from ckptstream._checkpoint import mapped as _mapped
from ckptstream._storage import mapping
from tests.helpers import assert_same_state, engine_threads, header_of, random_bytes, random_tensor

KiB = 1024


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def three_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three checksum threads whatever the machine's cores (the real piece and task sizes)."""
    monkeypatch.setattr(_mapped, "threads", lambda io, hot: 3)


def many_tensors() -> dict[str, torch.Tensor]:
    """More tensors than a batch of those made between two of the caller's tasks (so the caller
    takes tasks while it builds), large ones (each a task's piece), a tensor of several pieces,
    small ones between (the caller's own), and one of another dtype."""
    state: dict[str, torch.Tensor] = {}
    for i in range(3 * _mapped.BATCH):
        state[f"w{i:03d}"] = random_tensor((10 * KiB + i,) if i % 5 else (9 + i,))
    state["split"] = random_tensor(((2 * _mapped.PIECE + 12_345) // 4,))
    state["last"] = random_tensor((300 * KiB // 8 + 3,), torch.float64)
    return state


def flip(path: Path, at: int, raw: bytes) -> None:
    damaged = bytearray(raw)
    damaged[at] ^= 0x20
    path.write_bytes(damaged)


def where_to_flip(path: Path) -> list[tuple[str, int]]:
    """(tensor, absolute file offset) of the bytes to damage, one at a time."""
    start, header = header_of(path)

    def at(name: str, delta: int) -> tuple[str, int]:
        lo, hi = header[name]["data_offsets"]
        return name, start + (lo + delta if delta >= 0 else hi + delta)

    in_file = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    first, second, last = in_file[0], in_file[1], in_file[-1]  # the writer orders them its own way
    return [at(first, 0), at(second, 0), at(second, -1), at(in_file[_mapped.BATCH + 1], 77),
            at("split", _mapped.PIECE - 1), at("split", _mapped.PIECE), at("split", 2 * _mapped.PIECE),
            at(last, 0), at(last, -1), at("last", 5)]


@pytest.mark.parametrize("pages", ["as they are", "never resident"])
def test_a_corrupt_byte_anywhere_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, three_threads: None,
                                           pages: str) -> None:
    if pages == "never resident":  # every task populated first
        monkeypatch.setattr(mapping.Mapping, "resident", lambda self, lo, hi: False)
    state = many_tensors()
    path = tmp_path / "many.safetensors"
    ckptstream.save(state, path)
    assert_same_state(ckptstream.load(path), state, device="cpu")
    raw = path.read_bytes()
    for name, at in where_to_flip(path):
        flip(path, at, raw)
        with pytest.raises(CorruptCheckpointError, match=rf"{path}: tensor '{name}' fails its CRC-32C check"):
            ckptstream.load(path)
        assert engine_threads() == []
        damaged = ckptstream.load(path, checksum=False)  # the byte that was flipped, as it is in the file
        start, header = header_of(path)
        begin = at - start - header[name]["data_offsets"][0]
        assert damaged[name].view(torch.uint8).reshape(-1)[begin].item() == raw[at] ^ 0x20
    path.write_bytes(raw)
    assert_same_state(ckptstream.load(path), state, device="cpu")


def test_resident_tasks_are_read_as_they_are_and_others_populated_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, three_threads: None) -> None:
    state = many_tensors()
    path = tmp_path / "many.safetensors"
    ckptstream.save(state, path)
    populated: list[tuple[int, int]] = []
    real = mapping.Mapping.prefetch

    def counted(self: Any, lo: int, hi: int) -> bool:
        populated.append((lo, hi))
        return real(self, lo, hi)

    monkeypatch.setattr(mapping.Mapping, "prefetch", counted)
    path.read_bytes()  # in the page cache
    assert_same_state(ckptstream.load(path), state, device="cpu")
    assert populated == []
    # pages said to be out of the cache: each task of large pieces is brought in, once
    monkeypatch.setattr(mapping.Mapping, "resident", lambda self, lo, hi: False)
    assert_same_state(ckptstream.load(path), state, device="cpu")
    start, header = header_of(path)
    base = start % mmap.PAGESIZE  # the mapping begins at the page that holds the data's start
    assert populated
    assert len(populated) == len(set(populated))
    spans = [(base + lo, base + hi) for lo, hi in (header[k]["data_offsets"] for k in state)]
    for _, first, end in _mapped._pieces(spans):
        if end - first >= _mapped.RELEASES_GIL:  # a threads' piece: every byte in one populated range
            assert sum(max(0, min(b, end) - max(a, first)) for a, b in populated) == end - first


def test_the_mappings_residency_sample(tmp_path: Path) -> None:
    path = tmp_path / "bytes.bin"
    path.write_bytes(random_bytes(3 * 1024 * KiB + 5).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        path.read_bytes()
        m = mapping.Mapping(fd, 0, os.path.getsize(path), str(path))
        assert m.resident(0, os.path.getsize(path))
        assert m.resident(4096 + 3, 4096 + 10)
        assert m.resident(100, 100)  # nothing to read
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the cache
        if m.resident(0, 64 * KiB):
            pytest.skip("the kernel kept the file's pages in the cache")
        assert not m.resident(0, os.path.getsize(path))
        if m.prefetch(0, os.path.getsize(path)):  # populated (the kernel can): in the cache again
            assert m.resident(0, os.path.getsize(path))
        assert bytes(memoryview(m.buffer)[:16]) == path.read_bytes()[:16]
    finally:
        os.close(fd)


def test_the_caller_checksums_tasks_while_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_mapped, "TASK", 64 * KiB)
    monkeypatch.setattr(_mapped, "RELEASES_GIL", 1024)
    monkeypatch.setattr(_mapped, "THREADED_FROM", 1)
    half = _mapped.TASK // 2
    data = random_bytes(40 * _mapped.TASK + 123).numpy().tobytes()
    spans = [(i * half, (i + 1) * half) for i in range(80)] + [(80 * half, len(data))]
    caller = threading.current_thread()
    built = threading.Event()
    during: list[str] = []
    real = _checksum.crc_of

    def crc_of(view: Any) -> int:
        if not built.is_set():
            during.append(threading.current_thread().name)
        return real(view)

    class Region:
        buffer = bytearray(data)

        def prefetch(self, lo: int, hi: int) -> bool:
            if threading.current_thread() is not caller:
                built.wait()  # the other threads hold their first task until the state is made
            return False

        def resident(self, lo: int, hi: int) -> bool:
            return False

    def build(share: Any) -> str:
        for _ in range(4):
            share()
        built.set()
        return "built"

    monkeypatch.setattr(_checksum, "crc_of", crc_of)
    crcs, out = _mapped.span_crcs(Region(), spans, 3, meanwhile=build)
    assert out == "built"
    assert crcs == [real(data[lo:hi]) for lo, hi in spans]
    assert during == [caller.name] * 8  # four tasks of two pieces each, in the caller's thread
    assert engine_threads() == []
