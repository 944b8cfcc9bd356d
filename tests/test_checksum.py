"""CRC-32C: per-piece CRCs combine into the CRC of the concatenation, and the engines'
per-piece checksums (computed chunk by chunk on I/O threads) equal crc32c of each tensor's bytes."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import crc32c
import pytest
import torch

from ckptstream import Settings, _checksum
from ckptstream._engine import Piece, ReadEngine, WriteEngine
from ckptstream._storage import local
from ckptstream._storage.files import FileSink, FileSource
from tests.helpers import EDGE_CASES, as_bytes, assert_bytes_equal, packed_pieces, poisoned_like


def crc(data: bytes) -> int:
    return int(crc32c.crc32c(data))


def combine_pieces(pieces: list[tuple[int, int]]) -> int:
    """CRC-32C of consecutive pieces given as (crc, length), folded as the engines do."""
    return _checksum.span_crcs(1, [[(0, c, n) for c, n in pieces]])[0]


def test_check_value() -> None:
    assert _checksum.crc_of(b"123456789") == 0xE3069283  # the published CRC-32C check value
    assert _checksum.crc_of(memoryview(b"123456789")[3:]) == crc(b"456789")


def test_multiply_by_zero() -> None:
    assert _checksum.multiply(0, 0x12345678) == 0
    assert _checksum.multiply(0x12345678, 0) == 0


@pytest.mark.parametrize("seed", range(25))
def test_combine_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.choice([0, 1, 7, rng.randrange(2, 5000)]))
    # repeated cuts make empty pieces, cuts at 0 and len(data) empty first/last pieces
    cuts = sorted(rng.randrange(0, len(data) + 1) for _ in range(rng.randrange(0, 9)))
    bounds = [0, *cuts, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    assert b"".join(pieces) == data
    assert combine_pieces([(crc(p), len(p)) for p in pieces]) == crc(data)
    k = rng.randrange(0, len(data) + 1)
    assert _checksum.combine(crc(data[:k]), crc(data[k:]), len(data) - k) == crc(data)


def test_combine_with_empty_pieces() -> None:
    a = crc(b"payload")
    assert _checksum.combine(a, crc(b""), 0) == a
    assert _checksum.combine(crc(b""), a, 7) == a
    assert combine_pieces([]) == crc(b"") == 0
    assert combine_pieces([(0, 0), (a, 7), (0, 0)]) == a


def test_combine_large_pieces() -> None:
    rng = random.Random(7)
    data = rng.randbytes((16 << 20) + 12345)
    for k in (1, 4096, 1 << 20, 16 << 20):
        assert _checksum.combine(crc(data[:k]), crc(data[k:]), len(data) - k) == crc(data)
    # runs of zeros built by doubling agree with direct computation up to 16 MiB
    zeros = crc(b"\0")
    for n in range(1, 25):
        zeros = _checksum.combine(zeros, zeros, 1 << (n - 1))
        if n in (12, 20, 24):
            assert zeros == crc(bytes(1 << n))


def _crc_of_zeros(n: int, value: int = 0) -> int:
    """crc32c continued from ``value`` over ``n`` zero bytes, computed directly."""
    block = bytes(16 << 20)
    while n:
        step = min(n, len(block))
        value = int(crc32c.crc32c(memoryview(block)[:step], value))
        n -= step
    return value


def test_combine_past_2_pow_29_bytes() -> None:
    """Lengths with bits 28 and 29 set use the last entry of the x^(2^k) table and then wrap to
    its first; checked against a direct computation over 768 MiB of zeros."""
    n = (1 << 29) + (1 << 28) + 12345
    a = crc(b"some data before the zeros")
    assert _checksum.combine(a, _crc_of_zeros(n), n) == _crc_of_zeros(n, a)


@pytest.mark.parametrize("lengths", [(5 << 30, 3 << 32), (1 << 40, 12345), (4097, (1 << 33) + 1)])
def test_combine_is_associative_for_huge_lengths(lengths: tuple[int, int]) -> None:
    """For lengths too large to checksum here: (A+B)+C == A+(B+C) holds only if the shift by
    len(B) followed by len(C) equals the shift by len(B)+len(C)."""
    rng = random.Random(sum(lengths))
    a, b, c = (rng.getrandbits(32) for _ in range(3))
    len_b, len_c = lengths
    left = _checksum.combine(_checksum.combine(a, b, len_b), c, len_c)
    right = _checksum.combine(a, _checksum.combine(b, c, len_c), len_b + len_c)
    assert left == right
    assert _checksum.combine(a, b, len_b) != _checksum.combine(a, b, len_b + 1)


@pytest.mark.parametrize("buffer_size", [7, 4096, 1 << 20])
def test_engine_checksums_per_tensor(device: torch.device, tmp_path: Path, buffer_size: int) -> None:
    """Tensors packed back to back (several per chunk, or one over many chunks, cut mid-element):
    the write engine and the read engine (into tensors, or only checksumming bytes) return
    crc32c of each tensor's logical bytes."""
    sources = [case.source(device) for case in EDGE_CASES]
    pieces = packed_pieces(sources, 3)
    expected = [crc(as_bytes(t)) for t in sources]
    path = tmp_path / "packed.bin"
    cfg = Settings(buffer_size=buffer_size, num_buffers=3, io_threads=3)
    with local.opened(path, None, FileSink) as (file, _):
        assert WriteEngine(file, pieces, cfg, checksum=True).run() == expected
    assert crc(path.read_bytes()) == combine_pieces([(crc(bytes(3)), 3)] + [
        (c, p.nbytes) for c, p in zip(expected, pieces, strict=True)])

    read_cfg = Settings(buffer_size=buffer_size + 5, num_buffers=2, io_threads=2)
    bytes_only = [Piece.unread(p.nbytes, p.offset) for p in pieces]
    targets = [poisoned_like(t) for t in sources]
    into = [Piece.of(t, p.offset) for t, p in zip(targets, pieces, strict=True)]
    with local.opened(path, 0, FileSource) as (file, _):
        assert ReadEngine(file, bytes_only, read_cfg, checksum=True).run() == expected
        assert ReadEngine(file, into, read_cfg, checksum=True).run() == expected
    for target, source in zip(targets, sources, strict=True):
        assert_bytes_equal(target, source)
