"""The engines driven from outside: WriteEngine / ReadEngine started, waited on (from another
thread, with a timeout) and cancelled; pieces that are byte ranges of tensors, reads with holes
and overlaps, the checks on a write's pieces, and the CRC-32C of every piece."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from ckptstream import DirectIO, Settings
from ckptstream._engine import Piece, ReadEngine, TransferCancelled, WriteEngine
from ckptstream._engine.buffers import POOL
from ckptstream._storage import fileio, local
from ckptstream._storage.files import FileSink, FileSource
from tests.helpers import (
    EDGE_CASES,
    POISON_BYTE,
    as_bytes,
    assert_bytes_equal,
    engine_threads,
    packed_pieces,
    poison,
    poisoned_like,
    random_bytes,
    random_tensor,
)

SMALL = Settings(buffer_size=4096, num_buffers=2, io_threads=2, direct_io=DirectIO.OFF)


def crc(data: bytes) -> int:
    return int(crc32c.crc32c(data))


@contextlib.contextmanager
def open_file(path: Path, writing: bool) -> Iterator[Any]:
    flags = os.O_RDWR | os.O_CREAT if writing else os.O_RDONLY
    kind = FileSink if writing else FileSource
    file = kind(os.open(path, flags | os.O_CLOEXEC, 0o644), str(path), owned=True)
    try:
        yield file
    finally:
        file.close()


@pytest.fixture
def slow_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pwrite and pread takes at least 5 ms: a transfer of many chunks takes a while."""
    for name in ("pwrite_all", "pread_into", "preadv_all"):
        real = getattr(fileio, name)

        def slow(*args: Any, real: Any = real) -> Any:
            time.sleep(0.005)
            return real(*args)

        monkeypatch.setattr(fileio, name, slow)


def assert_idle() -> None:
    """No engine thread alive and every staging buffer back in the pool."""
    assert engine_threads() == []
    assert POOL.in_use == 0


# --- driven from outside ------------------------------------------------------------------------


@pytest.mark.parametrize("engine_type", ["write", "read"])
def test_start_here_and_wait_in_another_thread(tmp_path: Path, engine_type: str) -> None:
    src = random_tensor((300, 70), torch.float32)
    path = tmp_path / "t.bin"
    path.write_bytes(as_bytes(src) if engine_type == "read" else b"")
    dst = poisoned_like(src.t()).t()  # non-contiguous: through the staging buffers
    results: list[list[int]] = []
    with open_file(path, writing=engine_type == "write") as file:
        if engine_type == "write":
            engine: WriteEngine | ReadEngine = WriteEngine(file, [Piece.of(src, 0)], SMALL, checksum=True)
        else:
            engine = ReadEngine(file, [Piece.of(dst, 0)], SMALL, checksum=True)
        assert not engine.done()
        assert engine.start() is engine
        waiter = threading.Thread(target=lambda: results.append(engine.wait()))
        waiter.start()
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        assert engine.done()
    assert results == [[crc(as_bytes(src))]]
    if engine_type == "write":
        assert path.read_bytes() == as_bytes(src)
    else:
        assert_bytes_equal(dst, src)
    assert_idle()


def test_an_engine_starts_once_and_is_waited_on_after_it_started(tmp_path: Path) -> None:
    with open_file(tmp_path / "t.bin", writing=True) as file:
        engine = WriteEngine(file, [Piece.of(random_bytes(10000), 0)], SMALL)
        with pytest.raises(RuntimeError, match="start the engine before waiting"):
            engine.wait()
        engine.start()
        with pytest.raises(RuntimeError, match="starts once"):
            engine.start()
        assert engine.wait() == []  # no checksums asked for
    assert_idle()


@pytest.mark.usefixtures("slow_io")
@pytest.mark.parametrize("engine_type", ["write", "read"])
def test_cancel_mid_way(tmp_path: Path, engine_type: str) -> None:
    src = random_bytes(100 * 4096)
    path = tmp_path / "t.bin"
    path.write_bytes(as_bytes(src) if engine_type == "read" else b"")
    moved, first = [0], threading.Event()

    def progress(n: int) -> None:
        moved[0] += n
        first.set()

    dst = poisoned_like(src).view(400, 1024).t()
    with open_file(path, writing=engine_type == "write") as file:
        if engine_type == "write":
            engine: WriteEngine | ReadEngine = WriteEngine(file, [Piece.of(src, 0)], SMALL, progress=progress)
        else:
            engine = ReadEngine(file, [Piece.of(dst, 0)], SMALL, progress=progress)
        engine.start()
        assert first.wait(timeout=30)
        engine.cancel()
        with pytest.raises(TransferCancelled, match="cancelled"):
            engine.wait()
        assert engine.done()
    assert 0 < moved[0] < src.numel()  # stopped part of the way
    assert_idle()


@pytest.mark.usefixtures("slow_io")
def test_wait_with_a_timeout(tmp_path: Path) -> None:
    src = random_bytes(100 * 4096)
    path = tmp_path / "t.bin"
    with open_file(path, writing=True) as file:
        engine = WriteEngine(file, [Piece.of(src, 0)], SMALL, checksum=True)
        engine.start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 0\.05 s"):
            engine.wait(timeout=0.05)
        assert time.monotonic() - t0 < 5
        assert not engine.done()
        assert POOL.in_use == 2  # the transfer goes on with its buffers
        assert engine.wait() == [crc(as_bytes(src))]
    assert path.read_bytes() == as_bytes(src)
    assert_idle()


@pytest.mark.usefixtures("slow_io")
@pytest.mark.parametrize("engine_type", ["write", "read"])
def test_leaving_the_with_block_by_an_exception_joins_the_threads(tmp_path: Path, engine_type: str) -> None:
    src = random_bytes(100 * 4096)
    path = tmp_path / "t.bin"
    path.write_bytes(as_bytes(src) if engine_type == "read" else b"")
    moved = [0]

    def progress(n: int) -> None:
        moved[0] += n

    with open_file(path, writing=engine_type == "write") as file:
        if engine_type == "write":
            engine: WriteEngine | ReadEngine = WriteEngine(file, [Piece.of(src, 0)], SMALL, progress=progress)
        else:
            dst = poisoned_like(src).view(400, 1024).t()
            engine = ReadEngine(file, [Piece.of(dst, 0)], SMALL, progress=progress)

        def started_then_failing() -> None:
            with engine:
                engine.start()
                assert engine_threads() != []
                _ = 1 // 0

        with pytest.raises(ZeroDivisionError):
            started_then_failing()
        assert engine.done()
        assert_idle()
        stopped_at = moved[0]
        time.sleep(0.05)
        assert moved[0] == stopped_at  # nothing moves any more
        assert stopped_at < src.numel()  # stopped before the end


# --- pieces -------------------------------------------------------------------------------------


def test_byte_ranges_of_tensors_written_back_to_back(tmp_path: Path) -> None:
    a = random_tensor(1000, torch.float32)
    b = random_tensor((30, 17), torch.int16).t()  # non-contiguous: ranges cut at whole elements
    pieces = [Piece(a, 0, 100, 3001), Piece(b, 2901, 34, 1000), Piece(a, 3867, 3001, 4000), Piece(b, 4866, 0, 34)]
    with open_file(tmp_path / "t.bin", writing=True) as file:
        crcs = WriteEngine(file, pieces, SMALL, checksum=True).run()
    expected = [as_bytes(a)[100:3001], as_bytes(b)[34:1000], as_bytes(a)[3001:4000], as_bytes(b)[:34]]
    assert (tmp_path / "t.bin").read_bytes() == b"".join(expected)
    assert crcs == [crc(e) for e in expected]


def test_reads_with_holes_and_overlaps(tmp_path: Path) -> None:
    data = random_bytes(50000)
    path = tmp_path / "t.bin"
    path.write_bytes(as_bytes(data))
    raw = as_bytes(data)
    whole = poisoned_like(torch.empty(3000, dtype=torch.uint8))
    overlap = poisoned_like(torch.empty(1000, dtype=torch.uint8))  # bytes 1500..2500, inside ``whole``'s
    far = poisoned_like(torch.empty(100, 40, dtype=torch.int16)).t()  # non-contiguous, after a hole
    part = poisoned_like(torch.empty(500, dtype=torch.uint8))
    pieces = [Piece.of(whole, 1000), Piece.of(overlap, 1500), Piece.of(far, 20001),
              Piece(part, 49000, 100, 500), Piece.unread(3000, 30000)]
    for cfg in (SMALL, Settings(buffer_size=4100, num_buffers=3, io_threads=3, direct_io=DirectIO.OFF)):
        with open_file(path, writing=False) as file:
            crcs = ReadEngine(file, pieces, cfg, checksum=True).run()
        assert as_bytes(whole) == raw[1000:4000]
        assert as_bytes(overlap) == raw[1500:2500]
        assert as_bytes(far) == raw[20001:28001]
        assert as_bytes(part)[100:] == raw[49000:49400]
        assert as_bytes(part)[:100] == bytes([POISON_BYTE]) * 100  # outside the piece's range
        assert crcs == [crc(raw[1000:4000]), crc(raw[1500:2500]), crc(raw[20001:28001]), crc(raw[49000:49400]),
                        crc(raw[30000:33000])]
        for t in (whole, overlap, far, part):
            poison(t)
    assert_idle()


@pytest.mark.parametrize("seed", range(4))
def test_spans_get_a_checksum_each_however_chunks_cut_them(device: torch.device, tmp_path: Path, seed: int) -> None:
    """Pieces that each hold many spans (as a whole load's runs of small tensors do), random span
    lengths, chunks that cut spans, hold one span's middle, or several spans whole."""
    rng = random.Random(seed)
    data = random_bytes(4_000_000)
    path = tmp_path / "t.bin"
    path.write_bytes(as_bytes(data))
    raw = as_bytes(data)
    memory: list[torch.Tensor] = []
    pieces, spans, at = [], [], 4 * rng.randrange(0, 64)
    for _ in range(3):
        begin = at
        for _ in range(rng.randrange(1, 60)):
            n = rng.choice((4, 8, 1024, 4096)) * rng.randrange(1, 6)
            spans.append((at, at + n))
            at += n + 4 * rng.choice((0, 0, 0, 1, 9))  # back to back, or with padding between
        memory.append(poisoned_like(torch.empty(at - begin, dtype=torch.uint8, device=device)))
        pieces.append(Piece.of(memory[-1], begin))
        at += 4 * rng.randrange(0, 300)  # a hole between pieces
    for cfg in (SMALL, Settings(buffer_size=rng.choice((4096, 8192, 12288)) * 2, num_buffers=3, io_threads=3,
                                direct_io=DirectIO.OFF)):
        with open_file(path, writing=False) as file:
            crcs = ReadEngine(file, pieces, cfg, checksum=True, spans=spans).run()
        assert crcs == [crc(raw[b:e]) for b, e in spans]
        for m, p in zip(memory, pieces, strict=True):
            assert as_bytes(m) == raw[p.offset : p.end]
            poison(m)
    assert_idle()


@pytest.mark.parametrize(("pieces", "message"), [
    (lambda a, b: [Piece.of(a, 0), Piece.of(b, a.nbytes + 1)], "back to back"),  # a hole
    (lambda a, b: [Piece.of(a, 0), Piece.of(b, a.nbytes - 1)], "back to back"),  # an overlap
    (lambda a, b: [Piece.of(b, a.nbytes), Piece.of(a, 0), Piece.of(b, 10**6)], "back to back"),
    (lambda a, b: [Piece(a, 0, 0, a.nbytes + 1)], "runs past the tensor"),
    (lambda a, b: [Piece(a, -1, 0, 4)], "non-negative"),
    (lambda a, b: [Piece(a, 0, 8, 4)], "ordered"),
    (lambda a, b: [Piece(b.t(), 0, 1, 4)], "whole elements"),
], ids=["hole", "overlap", "out_of_order_hole", "past_the_end", "negative_offset", "reversed", "cut_element"])
def test_bad_write_pieces_are_refused(tmp_path: Path, pieces: Any, message: str) -> None:
    a, b = random_tensor(100), random_tensor((10, 7), torch.float64)
    path = tmp_path / "t.bin"
    with open_file(path, writing=True) as file, pytest.raises(ValueError, match=message):
        WriteEngine(file, pieces(a, b), SMALL)
    assert path.read_bytes() == b""
    assert_idle()


def test_empty_pieces_between_write_pieces_are_fine(tmp_path: Path) -> None:
    a, b = random_tensor(100), random_tensor(7)
    pieces = [Piece.of(a, 0), Piece.of(torch.empty(0), 12345), Piece.of(b, 400)]
    with open_file(tmp_path / "t.bin", writing=True) as file:
        assert WriteEngine(file, pieces, SMALL, checksum=True).run() == [crc(as_bytes(a)), 0, crc(as_bytes(b))]
    assert (tmp_path / "t.bin").read_bytes() == as_bytes(a) + as_bytes(b)


@pytest.mark.parametrize(("write_size", "read_size"), [(64, 100), (4096, 8192), (1 << 20, 1 << 20)])
def test_many_pieces_back_to_back(device: torch.device, tmp_path: Path, write_size: int, read_size: int) -> None:
    """Every edge case, packed back to back from an unaligned offset: small tensors share chunks,
    large ones span several, and each lands at its own offset; the CRC of each is returned."""
    sources = [case.source(device) for case in EDGE_CASES]
    pieces = packed_pieces(sources, 7)
    path = tmp_path / "packed.bin"
    cfg = Settings(buffer_size=write_size, num_buffers=3, io_threads=2)
    with local.opened(path, None, FileSink) as (file, _):
        crcs = WriteEngine(file, pieces, cfg, checksum=True).run()
    assert path.read_bytes() == bytes(7) + b"".join(as_bytes(t) for t in sources)
    assert crcs == [crc(as_bytes(t)) for t in sources]

    bases, dsts = [], []
    for case, t in zip(EDGE_CASES, sources, strict=True):
        base, dst = case.destination(device) if case.writable else (poisoned_like(t),) * 2
        bases.append(base)
        dsts.append(dst)
    cfg = Settings(buffer_size=read_size, num_buffers=2, io_threads=2)
    with local.opened(path, 0, FileSource) as (file, _):
        crcs = ReadEngine(file, [Piece.of(d, p.offset) for d, p in zip(dsts, pieces, strict=True)], cfg,
                          checksum=True).run()
    assert crcs == [crc(as_bytes(t)) for t in sources]
    for case, t, base, dst in zip(EDGE_CASES, sources, bases, dsts, strict=True):
        assert_bytes_equal(dst, t)
        if case.writable:
            assert_bytes_equal(base, case.expected_base(t))
