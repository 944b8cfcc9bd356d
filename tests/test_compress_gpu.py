"""Chunks compressed and decompressed on the GPU with nvCOMP's Zstd (ckptstream._compress.gpu):
exact bytes, and the same standard zstd frames as the CPU path, both ways. The last test runs
everywhere: it decodes, on the CPU, chunks that the GPU wrote (tests/data/gpu-zstd-chunks.json,
made by scripts/make-gpu-compression-fixture.py on a GPU machine)."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ckptstream import _checksum
from ckptstream._compress import chunks, codecs, gpu, grouping
from ckptstream.errors import CorruptCheckpointError
from tests.helpers import EDGE_CASES, as_bytes, poisoned_like, random_bytes, random_tensor

FIXTURE = Path(__file__).parent / "data" / "gpu-zstd-chunks.json"
ZSTD_MAGIC = bytes.fromhex("28b52ffd")
needs_nvcomp = pytest.mark.skipif(not gpu.available(),
                                  reason="nvCOMP is not installed (pip install nvidia-nvcomp-cu13)")


def _weights(count: int, dtype: torch.dtype, device: str = "cuda") -> torch.Tensor:
    """Values shaped like trained weights (normal, small): their exponent planes compress."""
    return random_tensor(count, torch.float32, device).mul_(0.02).to(dtype)


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize(("dtype", "count", "chunk"), [
    (torch.bfloat16, 1_000_003, 64 * 1024), (torch.float32, 250_001, 1 << 20), (torch.complex64, 5001, 4096),
    (torch.float16, 70_001, 65536), (torch.float64, 3, 8), (torch.float32, 1, 4),
])
def test_gpu_chunks_decode_on_the_cpu_and_cpu_chunks_on_the_gpu(dtype, count, chunk):
    pytest.importorskip("zstandard")
    t = _weights(count, dtype)
    width = grouping.value_width(dtype)
    expected = as_bytes(t)
    made = gpu.encode(t, chunk, width)
    assert sum(c.size for c in made) == len(expected)
    assert chunks.crc_of_chunks(made) == _checksum.crc_of(expected)  # the uncompressed tensor's CRC
    if count > 1000:
        assert all(c.data[:4] == ZSTD_MAGIC for c in made if not c.raw)
        assert sum(not c.raw for c in made) >= len(made) - 1
    on_cpu = torch.empty(t.shape, dtype=dtype)
    chunks.decode(made, codecs.codec("zstd-1"), width, on_cpu)
    assert as_bytes(on_cpu) == expected
    from_cpu = chunks.encode(t.cpu(), codecs.codec("zstd-3"), chunk, width)
    on_gpu = poisoned_like(t)
    gpu.decode(from_cpu, width, on_gpu)
    assert as_bytes(on_gpu) == expected


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_every_edge_case_comes_back_from_gpu_chunks(case):
    t = case.source("cuda")
    width = grouping.value_width(t.dtype)
    made = gpu.encode(t, 64, width)  # small chunks: most tensors span several
    out = poisoned_like(t)
    gpu.decode(made, width, out)
    assert as_bytes(out) == as_bytes(t)


@pytest.mark.gpu
@needs_nvcomp
def test_incompressible_chunks_are_kept_as_is_and_come_back():
    noise = random_bytes(3 * 65536 + 5, "cuda")
    made = gpu.encode(noise, 65536, 1)
    assert [c.raw for c in made] == [True] * 4
    assert b"".join(c.data for c in made) == as_bytes(noise)
    mixed = torch.cat([_weights(65536, torch.bfloat16).view(torch.uint8), noise[:131072]]).view(torch.bfloat16)
    made = gpu.encode(mixed, 65536, 2)
    assert [c.raw for c in made] == [False, False, True, True]
    out = poisoned_like(mixed)
    gpu.decode(made, 2, out)
    assert as_bytes(out) == as_bytes(mixed)


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("where", ["frame", "raw"])
def test_a_corrupt_chunk_is_caught_on_the_gpu_and_named(where):
    t = _weights(40_000, torch.float32) if where == "frame" else random_bytes(160_000, "cuda").view(torch.float32)
    made = gpu.encode(t, 32 * 1024, 4)
    assert made[1].raw == (where == "raw")
    bad = bytearray(made[1].data)
    bad[len(bad) // 2] ^= 0x10
    made[1] = dataclasses.replace(made[1], data=bytes(bad))
    with pytest.raises(CorruptCheckpointError, match=r"master\.w: (chunk 1|its chunks do not decode)"):
        gpu.decode(made, 4, torch.empty_like(t), name="master.w")


@pytest.mark.gpu
@needs_nvcomp
def test_decoding_refuses_what_it_cannot_fill():
    t = _weights(1000, torch.float32)
    made = gpu.encode(t, 1024, 4)
    with pytest.raises(CorruptCheckpointError, match="hold 4000 bytes, its dtype and shape 4004"):
        gpu.decode(made, 4, torch.empty(1001, device="cuda"))
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        gpu.decode(made, 4, torch.empty(1000))


@pytest.mark.parametrize(("width", "count", "chunk", "which"), [
    (2, 10_007, 1024, "all"), (4, 4096, 1024, "all"), (4, 4097, 1024, "odd"), (8, 33, 64, "last"), (2, 1, 2, "all"),
    (1, 5000, 1024, "odd"), (1, 3000, 1000, "all"),
])
def test_batched_grouping_matches_chunk_by_chunk_and_undoes_the_chosen_chunks(width, count, chunk, which, device):
    data = random_bytes(count * width, device)
    bounds = grouping.chunk_bounds(data.numel(), chunk, width)
    planes = torch.full((len(bounds) * chunk,), 0xA5, dtype=torch.uint8, device=device)
    gpu._group_into(data, planes, bounds, chunk, width)
    for k, (lo, hi) in enumerate(bounds):
        assert torch.equal(planes[k * chunk : k * chunk + hi - lo], grouping.group(data[lo:hi], width))
    chosen = {"all": list(range(len(bounds))), "odd": list(range(1, len(bounds), 2)), "last": [len(bounds) - 1]}[which]
    back = torch.full_like(data, 0xA5)
    gpu._ungroup_into(planes, back, bounds, chunk, width, chosen)
    for k, (lo, hi) in enumerate(bounds):
        if k in chosen:
            assert torch.equal(back[lo:hi], data[lo:hi]), k
        else:
            assert bool((back[lo:hi] == 0xA5).all()), k  # a chunk not chosen is left alone


def _fixture() -> list[tuple[dict, list[chunks.Chunk], bytes]]:
    doc = json.loads(FIXTURE.read_text())
    out = []
    for entry in doc["tensors"]:
        made = [chunks.Chunk(base64.b64decode(c["data"]), c["raw"], c["size"], c["crc"]) for c in entry["chunks"]]
        out.append((entry, made, base64.b64decode(entry["bytes"])))
    return out


def test_chunks_written_on_a_gpu_decode_on_the_cpu():
    pytest.importorskip("zstandard")
    doc = json.loads(FIXTURE.read_text())
    assert "nvCOMP" in doc["written_by"]
    framed = 0
    for entry, made, expected in _fixture():
        dtype = getattr(torch, entry["dtype"])
        out = torch.full(entry["shape"], 7, dtype=dtype)
        chunks.decode(made, codecs.codec("zstd-1"), entry["width"], out, name=entry["name"])
        assert as_bytes(out) == expected, entry["name"]
        assert chunks.crc_of_chunks(made) == _checksum.crc_of(expected)
        framed += sum(not c.raw for c in made)
        assert all(c.data[:4] == ZSTD_MAGIC for c in made if not c.raw)
    assert framed >= 3  # frames made by the GPU, not only bytes kept as is


def test_a_flipped_bit_in_a_gpu_written_frame_is_named():
    pytest.importorskip("zstandard")
    entry, made, _ = next((e, m, b) for e, m, b in _fixture() if sum(not c.raw for c in m) >= 2)
    k = next(i for i, c in enumerate(made) if not c.raw)
    bad = bytearray(made[k].data)
    bad[-3] ^= 0x01
    made[k] = dataclasses.replace(made[k], data=bytes(bad))
    out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
    with pytest.raises(CorruptCheckpointError, match=rf"{entry['name']}: chunk {k} "):
        chunks.decode(made, codecs.codec("zstd-1"), entry["width"], out, name=entry["name"])
