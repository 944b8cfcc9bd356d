"""The header keys of compressed tensors (docs/format.md, "Compressed tensors (planned)"): which
`U8` entries are compressed tensors, their dtype, shape, codec and grouping, and the chunk table.
Written and read here, and checked whole before a reader allocates anything. Pure functions over
the metadata; not yet used by save or load.

    ckptstream.format       "2" where the file holds a compressed tensor
    ckptstream.chunk_bytes  C, decimal: every chunk of every compressed tensor but a tensor's last
    ckptstream.compressed   JSON {stored name: [name, dtype, shape, codec, width]}
    ckptstream.chunks       per compressed tensor in file order, per chunk 16 hex digits: the
                            stored size of its frame (0: kept as is) and its CRC-32C
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import torch

from .._errors import CorruptCheckpointError
from .header import _HEX, DTYPE_NAMES, DTYPES, PREFIX, element_count, parse_json

FORMAT_KEY, COMPRESSED_FORMAT = PREFIX + "format", "2"
CHUNK_BYTES_KEY = PREFIX + "chunk_bytes"
COMPRESSED_KEY = PREFIX + "compressed"
CHUNKS_KEY = PREFIX + "chunks"
SUFFIX = {"zstd": ".__zstd__", "lz4": ".__lz4__"}  # a stored name: the tensor's name and its codec's family
MIN_CHUNK = 64 * 1024
MAX_CHUNK = 1 << 30
_DIGITS = 16  # per chunk: 8 of stored size, 8 of CRC-32C


@dataclasses.dataclass(frozen=True)
class Blob:
    """One compressed tensor: its `U8` entry ``stored``, the tensor it holds, how it is coded."""

    stored: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: str  # a key of SUFFIX
    width: int  # the byte-grouping width (1: not grouped)

    @property
    def nbytes(self) -> int:
        """The tensor's uncompressed bytes."""
        count = element_count(self.shape)
        assert count is not None  # checked when read
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
    """A chunk of the table: ``stored`` bytes of frame (0: its bytes kept as is), ``crc`` the
    CRC-32C of its uncompressed bytes."""

    stored: int
    crc: int


def stored_name(name: str, codec: str) -> str:
    return name + SUFFIX[codec]


def chunk_sizes(nbytes: int, chunk_bytes: int) -> list[int]:
    """The uncompressed size of each chunk of a tensor of ``nbytes``."""
    return [min(chunk_bytes, nbytes - lo) for lo in range(0, nbytes, chunk_bytes)]


def encode_keys(blobs: list[tuple[Blob, list[ChunkEntry]]], chunk_bytes: int) -> dict[str, str]:
    """The header keys of ``blobs`` (in file order, each with its chunks)."""
    table = {b.stored: [b.name, DTYPE_NAMES[b.dtype], list(b.shape), b.codec, b.width] for b, _ in blobs}
    chunks = "".join(f"{c.stored:08x}{c.crc:08x}" for _, entries in blobs for c in entries)
    return {FORMAT_KEY: COMPRESSED_FORMAT, CHUNK_BYTES_KEY: str(chunk_bytes),
            COMPRESSED_KEY: json.dumps(table, separators=(",", ":")), CHUNKS_KEY: chunks}


def decode_keys(meta: Mapping[str, str], entries: list[tuple[str, int]], path: str
                ) -> list[tuple[Blob, list[ChunkEntry]]]:
    """The compressed tensors a header names, each with its chunks, in file order; ``entries``
    is the header's `U8` entries as (name, stored bytes) in file order. Everything is checked:
    the keys' syntax, each blob against its entry, the chunk table's length and that each blob's
    chunks add up to its stored bytes; a CorruptCheckpointError names the file and what is wrong."""
    if COMPRESSED_KEY not in meta:
        for key in (CHUNK_BYTES_KEY, CHUNKS_KEY):
            if key in meta:
                raise _corrupt(path, f"{key} without {COMPRESSED_KEY}")
        return []
    if meta.get(FORMAT_KEY) != COMPRESSED_FORMAT:
        raise _corrupt(path, f"it holds compressed tensors, so {FORMAT_KEY} must be {COMPRESSED_FORMAT!r}, got "
                             f"{meta.get(FORMAT_KEY)!r:.20}")  # fmt: skip
    chunk_bytes = _chunk_bytes(meta.get(CHUNK_BYTES_KEY), path)
    try:
        table = parse_json(meta[COMPRESSED_KEY])
    except ValueError as e:
        raise _corrupt(path, f"{COMPRESSED_KEY} is not valid JSON: {e}") from e
    if not isinstance(table, dict):
        raise _corrupt(path, f"{COMPRESSED_KEY} must be a JSON object, got {type(table).__name__}")
    sizes = dict(entries)
    blobs = [_blob(stored, fields, chunk_bytes, sizes, path) for stored, fields in table.items()]
    order = {name: i for i, (name, _) in enumerate(entries)}
    blobs.sort(key=lambda b: order[b.stored])
    return _chunks(meta.get(CHUNKS_KEY), blobs, sizes, chunk_bytes, path)


def _chunk_bytes(text: str | None, path: str) -> int:
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 12:
        raise _corrupt(path, f"{CHUNK_BYTES_KEY} must be a decimal number of bytes, got {text!r:.40}")
    value = int(text)
    if value < MIN_CHUNK or value > MAX_CHUNK or value & (value - 1):
        raise _corrupt(path, f"{CHUNK_BYTES_KEY} must be a power of two from {MIN_CHUNK} to {MAX_CHUNK}, got {value}")
    return value


def _blob(stored: str, fields: object, chunk_bytes: int, sizes: Mapping[str, int], path: str) -> Blob:
    where = f"{COMPRESSED_KEY}[{stored!r:.100}]"
    if not (isinstance(fields, list) and len(fields) == 5):
        raise _corrupt(path, f"{where} must be [name, dtype, shape, codec, width], got {fields!r:.100}")
    name, dtype, shape, codec, width = fields
    if codec not in SUFFIX:
        raise _corrupt(path, f"{where}: unknown codec {codec!r:.40}: expected one of {sorted(SUFFIX)}; a newer "
                             "ckptstream may read it")  # fmt: skip
    if not isinstance(name, str) or stored != stored_name(name, codec):
        raise _corrupt(path, f"{where}: a {codec} tensor named {name!r:.100} must be stored as "
                             f"{stored_name(str(name), codec)!r:.100}")  # fmt: skip
    if stored not in sizes:
        raise _corrupt(path, f"{where}: the tensor table has no U8 entry {stored!r:.100}")
    if dtype not in DTYPES:
        raise _corrupt(path, f"{where}: unknown dtype {dtype!r:.20}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)) or element_count(shape) is None:
        raise _corrupt(path, f"{where}: shape must be a list of sizes torch can hold, got {shape!r:.100}")
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    if type(width) is not int or width < 1 or element % width or chunk_bytes % width:
        raise _corrupt(path, f"{where}: a grouping width of {width!r:.20} does not divide its {dtype} elements "
                             f"of {element} bytes")  # fmt: skip
    return Blob(stored, name, DTYPES[dtype], tuple(shape), codec, width)


def _chunks(text: str | None, blobs: list[Blob], sizes: Mapping[str, int], chunk_bytes: int, path: str
            ) -> list[tuple[Blob, list[ChunkEntry]]]:
    counts = [len(chunk_sizes(b.nbytes, chunk_bytes)) for b in blobs]
    if text is None or len(text) != _DIGITS * sum(counts) or not set(text) <= _HEX:
        raise _corrupt(path, f"{CHUNKS_KEY} must be {_DIGITS * sum(counts)} lowercase hex digits ({sum(counts)} "
                             f"chunks of {len(blobs)} compressed tensors), got {text!r:.60}")  # fmt: skip
    out, at = [], 0
    for blob, count in zip(blobs, counts, strict=True):
        entries = [ChunkEntry(int(text[i : i + 8], 16), int(text[i + 8 : i + 16], 16))
                   for i in range(at, at + _DIGITS * count, _DIGITS)]
        at += _DIGITS * count
        plain = chunk_sizes(blob.nbytes, chunk_bytes)
        for k, (c, n) in enumerate(zip(entries, plain, strict=True)):
            if c.stored > n:
                raise _corrupt(path, f"{blob.name}: chunk {k} stores a frame of {c.stored} bytes for {n} bytes: a "
                                     "chunk that does not shrink is kept as is")  # fmt: skip
        total = sum(c.stored or n for c, n in zip(entries, plain, strict=True))
        if total != sizes[blob.stored]:
            raise _corrupt(path, f"{blob.name}: its chunks store {total} bytes, its entry {blob.stored!r:.100} "
                                 f"holds {sizes[blob.stored]}")  # fmt: skip
        out.append((blob, entries))
    return out


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}")
