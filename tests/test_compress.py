"""Byte-grouping and the CPU codecs (ckptstream._compress): exact bytes for every dtype and edge
case, chunk by chunk, and standard frames that decode back bit for bit."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from ckptstream._compress import codecs, grouping
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
    real = importlib.import_module

    def missing(name, *args):
        if name in ("zstandard", "lz4.frame"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", missing)
    for name in CODECS:
        with pytest.raises(ImportError, match=r"ckptstream\[compress\]"):
            codecs.codec(name)
