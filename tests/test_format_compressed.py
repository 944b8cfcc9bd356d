"""The header keys of compressed tensors (ckptstream._format.compressed): written and read back
exactly, and every way a header can be wrong refused, naming the file and what is wrong."""

from __future__ import annotations

import json
import random

import pytest
import torch

from ckptstream._format import compressed as cz
from ckptstream.errors import CorruptCheckpointError

C = 64 * 1024
PATH = "/ckpt/a.safetensors"


def _blob(name: str, dtype: torch.dtype, shape: tuple[int, ...], codec: str = "zstd", width: int = 2
          ) -> cz.Blob:
    return cz.Blob(cz.stored_name(name, codec), name, dtype, shape, codec, width)


def _state() -> tuple[list[tuple[cz.Blob, list[cz.ChunkEntry]]], list[tuple[str, int]]]:
    """Three compressed tensors (one of three chunks, the last short, one kept as is in part,
    an empty one) with random frame sizes and CRCs, and their U8 entries in file order."""
    rng = random.Random(7)
    blobs = [_blob("model.w", torch.bfloat16, (1000, 70)), _blob("adam.v", torch.float32, (3, 5001), "lz4", 4),
             _blob("empty", torch.float64, (0, 4), width=8)]
    out, entries = [], [("plain.bias", 400)]  # an ordinary U8 tensor among them
    for b in blobs:
        made = []
        for n in cz.chunk_sizes(b.nbytes, C):
            kept = rng.random() < 0.3
            made.append(cz.ChunkEntry(0 if kept else rng.randrange(1, n + 1), rng.getrandbits(32)))
        out.append((b, made))
        entries.append((b.stored, sum(c.stored or n for c, n in zip(made, cz.chunk_sizes(b.nbytes, C), strict=True))))
    return out, entries


def test_the_keys_come_back_exactly_in_file_order():
    blobs, entries = _state()
    meta = cz.encode_keys(blobs, C)
    assert meta[cz.FORMAT_KEY] == "2"
    assert len(meta[cz.CHUNKS_KEY]) == 16 * sum(len(c) for _, c in blobs)
    assert cz.decode_keys({**meta, "user": "x"}, entries, PATH) == blobs
    flipped = [entries[0], *reversed(entries[1:])]  # the file's order decides, not the JSON's
    back = cz.decode_keys(cz.encode_keys(list(reversed(blobs)), C), flipped, PATH)
    assert back == list(reversed(blobs))
    with pytest.raises(CorruptCheckpointError, match="its chunks store"):  # a table in another order
        cz.decode_keys(meta, flipped, PATH)
    assert cz.decode_keys({"user": "x"}, entries, PATH) == []  # an uncompressed file


def test_chunk_sizes_cover_the_tensor():
    assert cz.chunk_sizes(0, C) == []
    assert cz.chunk_sizes(C, C) == [C]
    assert cz.chunk_sizes(2 * C + 3, C) == [C, C, 3]


def _broken(change) -> tuple[dict[str, str], list[tuple[str, int]]]:
    blobs, entries = _state()
    meta = cz.encode_keys(blobs, C)
    table = json.loads(meta[cz.COMPRESSED_KEY])
    out = change(meta, table, entries)
    if out is not None:
        table = out
    meta[cz.COMPRESSED_KEY] = json.dumps(table) if not isinstance(table, str) else table
    return meta, entries


def _meta(edit):
    """A change of the keys themselves (``edit(meta, entries)``), the table left as is."""
    def change(meta, table, entries):
        edit(meta, entries)
    return change


def _set(key, value):
    def change(meta, table, entries):
        meta[key] = value
    return change


def _field(stored, index, value):
    def change(meta, table, entries):
        table[stored][index] = value
    return change


BAD = {
    "format 1": (_set(cz.FORMAT_KEY, "1"), "must be '2'"),
    "chunk bytes not a number": (_set(cz.CHUNK_BYTES_KEY, "64k"), "decimal number of bytes"),
    "chunk bytes not a power of two": (_set(cz.CHUNK_BYTES_KEY, "100000"), "power of two"),
    "chunk bytes below the least": (_set(cz.CHUNK_BYTES_KEY, "4096"), "power of two from 65536"),
    "table not JSON": (lambda m, t, e: "{", "not valid JSON"),
    "table a list": (lambda m, t, e: [1], "must be a JSON object"),
    "fields short": (lambda m, t, e: {**t, "model.w.__zstd__": t["model.w.__zstd__"][:4]},
                     r"must be \[name, dtype, shape, codec, width\]"),
    "width not a number": (_field("model.w.__zstd__", 4, None), "grouping width of None"),
    "unknown codec": (_field("model.w.__zstd__", 3, "brotli"), "unknown codec 'brotli'"),
    "stored under another name": (_field("model.w.__zstd__", 0, "model.x"), "must be stored as 'model.x.__zstd__'"),
    "unknown dtype": (_field("model.w.__zstd__", 1, "F128"), "unknown dtype 'F128'"),
    "negative size": (_field("model.w.__zstd__", 2, [-1, 70]), "shape must be"),
    "size not an int": (_field("model.w.__zstd__", 2, ["1000", 70]), "shape must be"),
    "size torch cannot hold": (_field("model.w.__zstd__", 2, [2**40, 2**40]), "shape must be"),
    "width not dividing the element": (_field("adam.v.__lz4__", 4, 3), "grouping width of 3"),
    "width wider than the element": (_field("model.w.__zstd__", 4, 4), "grouping width of 4"),
    "no such entry": (lambda m, t, e: {**t, "gone.__zstd__": ["gone", "F32", [4], "zstd", 4]},
                      "no U8 entry 'gone.__zstd__'"),
    "chunk table short": (_meta(lambda m, e: m.update({cz.CHUNKS_KEY: m[cz.CHUNKS_KEY][:-16]})), "lowercase hex"),
    "chunk table upper case": (_meta(lambda m, e: m.update({cz.CHUNKS_KEY: m[cz.CHUNKS_KEY].upper()})),
                               "lowercase hex"),
    "chunk table missing": (_meta(lambda m, e: m.pop(cz.CHUNKS_KEY)), "lowercase hex"),
    "sizes not adding up": (_meta(lambda m, e: e.__setitem__(1, (e[1][0], e[1][1] + 1))), "its chunks store"),
    "a frame past its chunk": (_meta(lambda m, e: m.update({cz.CHUNKS_KEY: f"{C + 1:08x}" + m[cz.CHUNKS_KEY][8:]})),
                               "chunk 0 stores a frame of 65537 bytes"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_wrong_header_is_refused_and_named(case):
    change, message = BAD[case]
    meta, entries = _broken(change)
    with pytest.raises(CorruptCheckpointError, match=rf"^{PATH}: .*({message})"):
        cz.decode_keys(meta, entries, PATH)


def test_chunk_keys_without_the_table_are_refused():
    with pytest.raises(CorruptCheckpointError, match=r"ckptstream\.chunks without ckptstream\.compressed"):
        cz.decode_keys({cz.CHUNKS_KEY: "00"}, [], PATH)
