"""Loads read one contiguous range of chunks per I/O thread, each thread on a descriptor of its
own (advised sequential), so that readahead follows every thread's stream: the bytes arrive
exact at any split, every range is read once, the descriptors are closed after a load that
succeeds or fails, and a source that cannot be reopened is read through itself."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine import read
from ckptstream._engine.plan import Chunk
from ckptstream._storage import fileio
from ckptstream._storage import files as files_mod
from ckptstream._storage.files import FileSource
from tests.helpers import open_fds, random_tensor


def chunks_of(sizes: list[int]) -> list[Chunk]:
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append(Chunk(index=i, start=at, stop=at + n, origin=at, parts=[]))
        at += n
    return out


@pytest.mark.parametrize(("sizes", "count"), [([8] * 17, 4), ([8] * 3, 8), ([1, 50, 1, 1, 1], 2), ([5], 3),
                                         ([3, 9, 4, 4, 8, 1, 7], 3)])
def test_the_ranges_cover_every_chunk_once_in_file_order(sizes: list[int], count: int) -> None:
    chunks = chunks_of(sizes)
    ranges = read._split(chunks, count)
    assert [c.index for r in ranges for c in r] == list(range(len(chunks)))  # contiguous, in order, once
    assert 1 <= len(ranges) <= count
    assert all(ranges)
    if len(set(sizes)) == 1 and len(sizes) >= count:  # equal chunks: ranges differ by one chunk at most
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def state_of(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    # sizes that cut elements across 64 KiB chunks, and tensors smaller than a chunk
    return {"a": random_tensor(100_003), "b": random_tensor((301, 77), dtype=torch.float16),
            "c": random_tensor(5, dtype=torch.int64), "d": random_tensor(65_537, dtype=torch.bfloat16)}


def spy_readers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Record each reader opened: its thread, and whether it is a descriptor of its own."""
    seen: list[tuple[str, bool]] = []
    real = FileSource.reader

    def spy(self: FileSource, resident: bool = False) -> object:
        r = real(self, resident)
        seen.append((threading.current_thread().name, r is not self and r.fd != self.fd))  # type: ignore[attr-defined]
        return r

    monkeypatch.setattr(FileSource, "reader", spy)
    return seen


def test_each_thread_reads_its_range_on_its_own_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_of(1)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    ranges_read: dict[str, list[int]] = {}
    real_move = read.ReadEngine._move

    def spy_move(self: read.ReadEngine, chunk: Chunk, buf: object) -> None:
        ranges_read.setdefault(threading.current_thread().name, []).append(chunk.index)
        real_move(self, chunk, buf)  # type: ignore[arg-type]

    monkeypatch.setattr(read.ReadEngine, "_move", spy_move)
    seen = spy_readers(monkeypatch)
    before = open_fds()
    cfg = Settings(buffer_size=64 << 10, num_buffers=4, io_threads=4, hot_io_threads=4, direct_io="off")
    loaded = ckptstream.load(path, mmap=False, settings=cfg)
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype, name
        assert torch.equal(loaded[name], t), name
    assert len({name for name, _ in seen}) == 4, seen
    assert all(own for _, own in seen), seen
    # each thread's chunks are one contiguous run, and together they are every chunk once
    runs = sorted(ranges_read.values())
    assert sorted(i for r in runs for i in r) == list(range(sum(map(len, runs))))
    assert all(r == list(range(r[0], r[0] + len(r))) for r in runs)
    assert len(runs) == 4
    assert set(open_fds()) <= set(before)  # every reader closed


def test_a_failed_load_closes_every_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state_of(2), path)
    calls = {"n": 0}

    def failing(real: Callable[..., int]) -> Callable[..., int]:
        def read_or_fail(fd: int, views: object, offset: int, p: str, *request: int | None) -> int:
            calls["n"] += 1
            if calls["n"] == 5:
                raise OSError(5, "Input/output error (planted)", p)
            return real(fd, views, offset, p, *request)
        return read_or_fail

    monkeypatch.setattr(fileio, "pread_into", failing(fileio.pread_into))
    monkeypatch.setattr(fileio, "preadv_all", failing(fileio.preadv_all))
    seen = spy_readers(monkeypatch)
    before = open_fds()
    cfg = Settings(buffer_size=64 << 10, num_buffers=4, io_threads=4, hot_io_threads=4, direct_io="off")
    with pytest.raises(OSError, match="planted"):
        ckptstream.load(path, mmap=False, settings=cfg)
    assert len(seen) == 4
    assert set(open_fds()) <= set(before)


def test_a_source_that_cannot_be_reopened_is_read_through_itself(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_of(3)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)

    def refuse(fd: int, flags: int) -> int:
        raise PermissionError(13, "no /proc here (planted)")

    monkeypatch.setattr(fileio, "reopen", refuse)
    before = open_fds()
    cfg = Settings(buffer_size=64 << 10, num_buffers=4, io_threads=4, hot_io_threads=4, direct_io="off")
    loaded = ckptstream.load(path, mmap=False, settings=cfg)
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name
    assert set(open_fds()) <= set(before)


def test_an_open_file_the_caller_passes_is_reopened_for_reading_only(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """file_to_device on the caller's read-write descriptor: the threads' readers are new,
    read-only descriptors of the same file, closed afterwards; the caller's stays open and
    where it was."""
    data = random_tensor(300_001)
    path = tmp_path / "raw.bin"
    path.write_bytes(data.numpy().tobytes())
    out = torch.empty_like(data)
    modes: list[int] = []
    real = FileSource.reader

    def spy(self: FileSource, resident: bool = False) -> object:
        r = real(self, resident)
        assert r is not self
        assert os.path.samestat(os.fstat(r.fd), os.fstat(self.fd))  # type: ignore[attr-defined]
        modes.append(fcntl.fcntl(r.fd, fcntl.F_GETFL) & os.O_ACCMODE)  # type: ignore[attr-defined]
        return r

    monkeypatch.setattr(FileSource, "reader", spy)
    fd = os.open(path, os.O_RDWR)
    try:
        before = open_fds()
        os.lseek(fd, 17, os.SEEK_SET)
        with ckptstream.settings(buffer_size=64 << 10, num_buffers=4, io_threads=4, direct_io="off"):
            ckptstream.file_to_device(fd, out, offset=0)
        assert torch.equal(out, data)
        assert modes == [os.O_RDONLY] * 4
        assert set(open_fds()) <= set(before)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 17
    finally:
        os.close(fd)


def test_non_contiguous_tensors_keep_the_turns(tmp_path: Path) -> None:
    """Their copies go in file order across the threads: chunks are taken in turn, not in ranges."""
    state = {"t": random_tensor((64, 1000)).t(), "u": random_tensor(50_000)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    target = {"t": torch.empty(64, 1000).t(), "u": torch.empty(50_000)}  # non-contiguous, as saved
    with ckptstream.settings(buffer_size=64 << 10, num_buffers=4, io_threads=4, direct_io="off"):
        ckptstream.load_into(target, path)
    assert torch.equal(target["t"], state["t"])
    assert torch.equal(target["u"], state["u"])


def test_a_threads_reader_asks_for_read_request_bytes_at_most(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks larger than READ_REQUEST are read in calls of at most that many bytes (the
    readahead each call starts runs on while the thread is busy), into staging buffers and
    straight into host tensors alike; the bytes arrive exact."""
    monkeypatch.setattr(files_mod, "READ_REQUEST", 48 << 10)
    torch.manual_seed(4)
    state = {"a": random_tensor(300_007), "b": random_tensor((70, 1001), dtype=torch.float16),
             "c": random_tensor(3, dtype=torch.int8)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    asked: list[int] = []
    real = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
        if threading.current_thread().name.startswith("ckptstream-read"):
            asked.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    cfg = Settings(buffer_size=256 << 10, num_buffers=4, io_threads=2, hot_io_threads=2, direct_io="off")
    for into_host in (True, False):
        asked.clear()
        if into_host:
            loaded = ckptstream.load(path, mmap=False, settings=cfg)
        else:
            loaded = {k: torch.empty_like(v) for k, v in state.items()}
            ckptstream.load_into(loaded, path, settings=cfg)
        for name, t in state.items():
            assert torch.equal(loaded[name], t), (name, into_host)
        assert asked
        assert max(asked) <= 48 << 10, (into_host, max(asked))


@pytest.mark.parametrize("request_bytes", [1, 7, 4096, 10_000, 1 << 20])
def test_preadv_all_in_requests_fills_every_view(tmp_path: Path, request_bytes: int) -> None:
    data = os.urandom(123_457)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    sizes = [1, 0, 5000, 33, 70_000, 48_500]  # the last one runs past the end of the file
    views = [memoryview(bytearray(b"\xa5" * n)) for n in sizes]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = fileio.preadv_all(fd, views, 100, str(path), request_bytes)
        one = memoryview(bytearray(30_001))
        assert fileio.pread_into(fd, one, 9, str(path), request_bytes) == 30_001
    finally:
        os.close(fd)
    assert got == len(data) - 100
    assert b"".join(bytes(v) for v in views)[:got] == data[100:]
    assert bytes(one) == data[9:30_010]
