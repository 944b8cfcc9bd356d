"""The CPU codecs: each compresses one chunk into one standard, self-contained frame (a zstd
frame, an LZ4 frame) that any library of that format decodes, and back.

The packages are optional (the ``compress`` extra): a codec is looked up by name when used, and a
missing package is named in the error with the command that installs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

Buffer = Any  # any object with the buffer protocol: bytes, memoryview, a numpy array of a tensor's bytes


@dataclasses.dataclass(frozen=True)
class Codec:
    """A named compressor: ``compress(data) -> frame``, ``decompress(frame, size) -> data``
    (``size`` the uncompressed length, which the chunk table records)."""

    name: str
    compress: Callable[[Buffer], bytes]
    decompress: Callable[[Buffer, int], bytes]


def _missing(name: str) -> ImportError:
    return ImportError(f"the {name} codec needs the {name!r} package: pip install 'ckptstream[compress]'")


def _zstd(level: int) -> Codec:
    try:
        import zstandard as zstd
    except ImportError as e:
        raise _missing("zstandard") from e
    # one compressor and decompressor per codec object would not be thread-safe: zstandard's
    # contexts may not be shared between threads, so each call makes its own (cheap next to a chunk)
    def compress(data: Buffer) -> bytes:
        frame: bytes = zstd.ZstdCompressor(level=level, write_content_size=True).compress(data)
        return frame

    def decompress(frame: Buffer, size: int) -> bytes:
        data: bytes = zstd.ZstdDecompressor().decompress(frame, max_output_size=size)
        return data

    return Codec(f"zstd-{level}", compress, decompress)


def _lz4() -> Codec:
    try:
        import lz4.frame as frame
    except ImportError as e:
        raise _missing("lz4") from e

    def compress(data: Buffer) -> bytes:
        out: bytes = frame.compress(data, store_size=True)
        return out

    def decompress(blob: Buffer, size: int) -> bytes:
        data: bytes = frame.decompress(blob)
        return data

    return Codec("lz4", compress, decompress)


def codec(name: str) -> Codec:
    """The codec called ``name``: ``zstd-1`` .. ``zstd-22`` or ``lz4``."""
    if name == "lz4":
        return _lz4()
    if name.startswith("zstd-") and name[5:].isdigit() and 1 <= int(name[5:]) <= 22:
        return _zstd(int(name[5:]))
    raise ValueError(f"unknown codec {name!r}: expected 'zstd-1' .. 'zstd-22' or 'lz4'")
