"""A tensor's bytes as independent compressed chunks, and back, on the CPU: what a compressed
tensor of docs/format.md ("Compressed tensors (planned)") stores, one frame per chunk.

Each chunk is byte-grouped (when ``width`` > 1), then encoded as one frame of the codec; a chunk
that does not shrink by ``keep_below`` is kept as is. Each chunk carries the CRC-32C of its
uncompressed bytes, so each is checked alone and a bad one named; combined, they give the
tensor's CRC, the same as that of the uncompressed tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _checksum
from .._errors import CorruptCheckpointError
from . import grouping
from .codecs import Codec

KEEP_BELOW = 0.97  # a chunk is stored compressed only when it shrinks by at least 3%


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored chunk: ``data`` the frame (or the raw bytes when ``raw``), ``size`` its
    uncompressed length, ``crc`` the CRC-32C of its uncompressed bytes."""

    data: bytes
    raw: bool
    size: int
    crc: int


def encode(t: torch.Tensor, codec: Codec, chunk_bytes: int, width: int, *,
           keep_below: float = KEEP_BELOW) -> list[Chunk]:
    """The chunks of ``t``'s logical bytes (any device: copied to the host chunk by chunk)."""
    data = grouping.tensor_bytes(t)
    out = []
    for lo, hi in grouping.chunk_bounds(data.numel(), chunk_bytes, width):
        part = data[lo:hi].cpu()
        plain = part.numpy()
        crc = _checksum.crc_of(plain.data)
        frame = codec.compress(grouping.group(part, width).numpy() if width > 1 else plain)
        if len(frame) <= keep_below * (hi - lo):
            out.append(Chunk(frame, False, hi - lo, crc))
        else:
            out.append(Chunk(plain.tobytes(), True, hi - lo, crc))
    return out


def crc_of_chunks(chunks: list[Chunk]) -> int:
    """The CRC-32C of the whole tensor's bytes, from its chunks' CRCs."""
    crc = _checksum.crc_of(b"")
    for c in chunks:
        crc = _checksum.combine(crc, c.crc, c.size)
    return crc


def decode(chunks: list[Chunk], codec: Codec, width: int, out: torch.Tensor, *, name: str = "tensor") -> None:
    """Fill ``out`` (a contiguous CPU tensor of the stored dtype and shape) from its chunks, each
    checked against its CRC; a chunk that fails is named in the CorruptCheckpointError."""
    dst = out.reshape(-1).view(torch.uint8)
    if sum(c.size for c in chunks) != dst.numel():
        raise CorruptCheckpointError(f"{name}: its chunks hold {sum(c.size for c in chunks)} bytes, "
                                     f"its dtype and shape {dst.numel()}")
    at = 0
    for i, c in enumerate(chunks):
        data: bytes | memoryview
        if c.raw:
            data = c.data
        else:
            try:
                data = codec.decompress(c.data, c.size)
            except Exception as e:  # each codec has its own error type for a bad frame
                raise CorruptCheckpointError(f"{name}: chunk {i} (uncompressed bytes {at}..{at + c.size}) does "
                                             f"not decode as {codec.name}: {e}") from e
            if len(data) != c.size:
                raise CorruptCheckpointError(f"{name}: chunk {i} decodes to {len(data)} bytes, expected {c.size}")
            if width > 1:
                data = grouping.ungroup(torch.frombuffer(bytearray(data), dtype=torch.uint8), width).numpy().data
        if _checksum.crc_of(data) != c.crc:
            raise CorruptCheckpointError(f"{name}: chunk {i} (uncompressed bytes {at}..{at + c.size}) does not "
                                         f"match its CRC-32C {c.crc:08x}")
        if c.size:
            dst[at : at + c.size] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        at += c.size
