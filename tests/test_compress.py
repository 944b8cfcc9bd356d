"""Byte-grouping and the CPU codecs (ckptstream._compress): exact bytes for every dtype and edge
case, chunk by chunk, and standard frames that decode back bit for bit."""

from __future__ import annotations

import dataclasses
import itertools
import sys

import pytest
import torch

from ckptstream import _checksum
from ckptstream._compress import chunks, codecs, grouping
from ckptstream.errors import CorruptCheckpointError
from tests.helpers import DTYPES, EDGE_CASES, as_bytes, random_bytes, random_tensor

CODECS = ("zstd-1", "zstd-3", "lz4")
FRAME_MAGIC = {"zstd": bytes.fromhex("28b52ffd"), "lz4": bytes.fromhex("04224d18")}


def _needs(name: str) -> None:
    pytest.importorskip("zstandard" if name.startswith("zstd") else "lz4")


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_grouping_puts_byte_j_of_every_element_in_plane_j_and_back(case, device):
    t = case.source(device)
    data = grouping.tensor_bytes(t)
    assert data.device == t.device
    assert data.cpu().numpy().tobytes() == as_bytes(t)
    width = grouping.value_width(t.dtype)
    planes = grouping.group(data, width)
    n = data.numel() // width
    for j in range(width):
        assert torch.equal(planes[j * n : (j + 1) * n], data[j::width])
    back = grouping.ungroup(planes, width)
    assert back.device == t.device
    assert torch.equal(back, data)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_value_width_of_every_dtype(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    expected = size // 2 if dtype.is_complex else size  # both halves of a complex number grouped alike
    assert grouping.value_width(dtype) == expected


@pytest.mark.parametrize(("dtype", "count", "chunk"), [
    (torch.float32, 1001, 64), (torch.bfloat16, 777, 10), (torch.complex128, 33, 48),
    (torch.float64, 5, 8), (torch.int8, 4097, 1000), (torch.float16, 1, 2),
])
def test_chunk_by_chunk_grouping_gives_the_tensor_back(dtype, count, chunk, device):
    t = random_tensor(count, dtype, device)
    data, width = grouping.tensor_bytes(t), grouping.value_width(dtype)
    bounds = grouping.chunk_bounds(data.numel(), chunk, width)
    assert bounds[0][0] == 0
    assert bounds[-1][1] == data.numel()
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    back = torch.cat([grouping.ungroup(grouping.group(data[lo:hi], width), width) for lo, hi in bounds])
    assert torch.equal(back, data)


def test_chunks_that_would_cut_elements_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        grouping.chunk_bounds(400, 6, 4)
    with pytest.raises(ValueError, match="whole number of elements"):
        grouping.group(random_bytes(10), 4)
    with pytest.raises(ValueError, match="1-D uint8"):
        grouping.group(torch.zeros(4, dtype=torch.int32), 4)
    assert grouping.chunk_bounds(0, 8, 4) == []


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kind", ["random", "zeros", "weights", "empty", "one_byte"])
def test_codec_frames_are_standard_and_decode_bit_for_bit(name, kind):
    _needs(name)
    data = {"random": random_bytes(1 << 20), "zeros": torch.zeros(100_003, dtype=torch.uint8),
            "weights": grouping.group(grouping.tensor_bytes(random_tensor(50_000, torch.bfloat16) * 0.02), 2),
            "empty": torch.zeros(0, dtype=torch.uint8), "one_byte": random_bytes(1)}[kind]
    c = codecs.codec(name)
    frame = c.compress(data.numpy())
    assert frame[:4] == FRAME_MAGIC[name.split("-")[0]]
    assert c.decompress(frame, data.numel()) == data.numpy().tobytes()
    if kind in ("zeros", "weights"):
        assert len(frame) < data.numel()


def test_unknown_codecs_are_named():
    for bad in ("zstd", "zstd-0", "zstd-23", "gzip", ""):
        with pytest.raises(ValueError, match="unknown codec"):
            codecs.codec(bad)


def test_a_missing_package_names_the_extra(monkeypatch):
    for name in ("zstandard", "lz4", "lz4.frame"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    for name in CODECS:
        with pytest.raises(ImportError, match=r"ckptstream\[compress\]"):
            codecs.codec(name)


# --- chunks: a tensor as independent frames ---------------------------------------------------


@pytest.mark.parametrize("name", ["zstd-1", "lz4"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_every_edge_case_comes_back_from_its_chunks_bit_for_bit(case, name, device):
    _needs(name)
    t = case.source(device)
    c, width = codecs.codec(name), grouping.value_width(t.dtype)
    stored = chunks.encode(t, c, 64, width)  # small chunks: most tensors span several
    assert sum(s.size for s in stored) == t.numel() * t.element_size()
    assert chunks.crc_of_chunks(stored) == _checksum.crc_of(as_bytes(t))  # the uncompressed tensor's CRC
    out = torch.empty(t.shape, dtype=t.dtype)
    chunks.decode(stored, c, width, out)
    assert out.reshape(-1).view(torch.uint8).numpy().tobytes() == as_bytes(t)


def test_state_like_tensors_compress_and_random_bytes_are_kept_as_is():
    _needs("zstd-1")
    c = codecs.codec("zstd-1")
    weights = torch.randn(100_000, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
    stored = chunks.encode(weights, c, 64 * 1024, 2)
    assert all(not s.raw for s in stored)
    assert sum(len(s.data) for s in stored) < 0.8 * weights.numel() * 2
    noise = random_bytes(300_001)
    stored = chunks.encode(noise, c, 64 * 1024, 1)
    assert all(s.raw and len(s.data) == s.size for s in stored)
    out = torch.empty_like(noise)
    chunks.decode(stored, c, 1, out)
    assert torch.equal(out, noise)


@pytest.mark.parametrize("where", ["frame", "raw"])
def test_a_corrupt_chunk_is_caught_and_named(where):
    _needs("zstd-1")
    c = codecs.codec("zstd-1")
    t = torch.randn(40_000).mul_(0.02) if where == "frame" else random_bytes(160_000).view(torch.float32)
    stored = chunks.encode(t, c, 32 * 1024, 4)
    assert stored[1].raw == (where == "raw")
    bad = bytearray(stored[1].data)
    bad[len(bad) // 2] ^= 0x10
    stored[1] = dataclasses.replace(stored[1], data=bytes(bad))
    with pytest.raises(CorruptCheckpointError, match=r"master\.w: chunk 1 \(uncompressed bytes 32768\.\.65536\)"):
        chunks.decode(stored, c, 4, torch.empty_like(t), name="master.w")


def test_chunks_that_do_not_add_up_to_the_tensor_are_refused():
    _needs("zstd-1")
    c = codecs.codec("zstd-1")
    stored = chunks.encode(torch.randn(1000), c, 1024, 4)
    with pytest.raises(CorruptCheckpointError, match="hold 4000 bytes, its dtype and shape 4004"):
        chunks.decode(stored, c, 4, torch.empty(1001))
