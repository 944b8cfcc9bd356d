"""CRC-32C per tensor, computed piece by piece on any thread and combined in order.

CRC-32C (Castagnoli) is hardware-accelerated by the ``crc32c`` package, releases the GIL, and,
unlike xxh3, can be *combined*: crc(A + B) follows from crc(A), crc(B) and len(B). That lets
several I/O threads checksum the chunks of one large tensor in parallel, without ordering
them, while the stored value stays the plain CRC-32C of the tensor's bytes (checkable by any
tool).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import crc32c

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def crc_of(data: bytes | bytearray | memoryview) -> int:
    return int(crc32c.crc32c(data))


def multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, in reflected bit order."""
    m, p = 1 << 31, 0
    if a == 0:
        return 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


# x^(2^k) mod P for k = 0..63 (lengths below 2^61 bytes). zlib's table of 32 that wraps with
# k & 31 is right for its polynomial only: for CRC-32C x^(2^31) = x, so that wrap goes wrong
# from 512 MiB on.
_X2N = [1 << 30]
for _ in range(63):
    _X2N.append(multiply(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=256)  # most pieces of a large tensor have the same few lengths
def shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo P: the operator that appends ``nbytes`` zero bytes."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = multiply(_X2N[k], p)
        nbytes >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of A followed by B, from the CRCs of each and the length of B."""
    if crc_a == 0:  # the shift below is linear: it maps 0 to 0 (A empty, or its CRC is 0)
        return crc_b
    return multiply(shift(len_b), crc_a) ^ crc_b if len_b else crc_a


def span_crcs(count: int, chunks: Iterable[list[tuple[int, int, int]]]) -> list[int]:
    """The CRC-32C of each of ``count`` byte spans, folded from their parts, given as (span,
    crc, length) chunk by chunk in file order."""
    values = [0] * count  # the CRC-32C of no bytes
    for parts in chunks:
        for span, crc, length in parts:
            values[span] = combine(values[span], crc, length)
    return values
