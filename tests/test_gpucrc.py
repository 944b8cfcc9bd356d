"""CRC-32C on the GPU (``_gpucrc``): the kernel equals crc32c on any length and start, loads that
verify into CUDA tensors checksum large pieces there and still catch every corrupt byte, and the
host path takes over where the kernel cannot run."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest
import torch

import ckptstream
from ckptstream import Settings, _checksum, _fileio, _gpucrc, _pipeline
from conftest import CUDA, EDGE_CASES, as_bytes, assert_bytes_equal, poisoned_like

needs_gpu = pytest.mark.skipif(not CUDA or _gpucrc.triton is None, reason="needs CUDA and Triton")


def crc(data: bytes) -> int:
    return int(crc32c.crc32c(data))


def test_finish_turns_a_register_into_the_crc() -> None:
    """finish(register of the bytes from 0, n) == crc32c; the register computed here bit by bit."""
    rng = random.Random(5)
    for n in (0, 1, 5, 64, 1000, 20000):
        data = rng.randbytes(n)
        register = 0
        for byte in data:
            register ^= byte
            for _ in range(8):
                register = (register >> 1) ^ _checksum._POLY if register & 1 else register >> 1
        assert _gpucrc.finish(register, n) == crc(data)


def test_tables_advance_the_register_by_bytes() -> None:
    tables = _gpucrc._tables()
    assert tables[1] == 0xF26B8303  # the first entries of the published CRC-32C byte table
    assert tables[128] == _checksum._POLY
    for k in range(1, 4):  # t[k][v]: byte v, then k zero bytes
        for v in (1, 77, 255):
            assert tables[k * 256 + v] == _checksum._multmodp(_checksum._x8nmodp(k), tables[v])


def test_host_only_without_cuda() -> None:
    assert not _gpucrc.usable(torch.device("cpu"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(3))
def test_kernel_equals_crc32c(seed: int) -> None:
    """Lengths around the lane and block sizes and random ones, 4-byte aligned starts (what
    ``eligible`` admits), many tensors per launch."""
    device = torch.device("cuda")
    assert _gpucrc.usable(device)
    rng = random.Random(seed)
    data = torch.randint(0, 256, (5 * _gpucrc.BLOCK + 4096,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    on_gpu = data.to(device)
    lengths = [4, 8, 252, 256, 260, _gpucrc.BLOCK - 4, _gpucrc.BLOCK, _gpucrc.BLOCK + 4,
               *(4 * rng.randrange(1, 5 * _gpucrc.BLOCK // 4) for _ in range(20))]
    starts = [4 * rng.randrange(0, 1000) for _ in lengths]
    got = _gpucrc.crcs([on_gpu[a : a + n] for a, n in zip(starts, lengths, strict=True)])
    assert got == [crc(data[a : a + n].numpy().tobytes()) for a, n in zip(starts, lengths, strict=True)]
    assert _gpucrc.crcs([on_gpu[:-4]]) == [crc(data[:-4].numpy().tobytes())]


INTERPRETED = """
import random, sys, crc32c, torch
from ckptstream import _gpucrc
rng = random.Random(1)
data = torch.randint(0, 256, (3 * _gpucrc.BLOCK + 4096,), dtype=torch.uint8)
spans = [(4 * rng.randrange(0, 1000), n) for n in (4, 252, 256, 260, _gpucrc.BLOCK, _gpucrc.BLOCK + 4, 2 * _gpucrc.BLOCK + 20)]
got = _gpucrc.crcs([data[a : a + n] for a, n in spans])
sys.exit(got != [crc32c.crc32c(data[a : a + n].numpy().tobytes()) for a, n in spans])
"""


@pytest.mark.skipif(_gpucrc.triton is None, reason="needs Triton")
def test_kernel_in_tritons_interpreter() -> None:
    """The kernel's arithmetic on the CPU, through Triton's interpreter (no GPU, no compiler)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", INTERPRETED], env=env, check=True, timeout=300)


def test_eligible_bytes() -> None:
    base = torch.empty(4 << 20, dtype=torch.uint8)
    assert _gpucrc.eligible(base) and _gpucrc.eligible(base[4:])
    assert not _gpucrc.eligible(base[2:-2])  # unaligned start
    assert not _gpucrc.eligible(base[:-2])  # not whole words
    assert not _gpucrc.eligible(base[: _gpucrc.GPU_FROM - 4])  # small: on the host


def _large_sources(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    fp32 = torch.randn(2_000_001, generator=gen).to(device)
    bf16 = torch.randn(1_300_001, generator=gen).to(torch.bfloat16).to(device)
    return [t.to(device) for t in (
        torch.randint(0, 256, ((5 << 20) + 3,), dtype=torch.uint8, generator=gen),  # not whole words
        torch.randint(0, 256, (6 << 20,), dtype=torch.uint8, generator=gen),
        bf16, bf16[1:-2],  # odd length; unaligned start
        torch.randn(3, 700_001, generator=gen),
        fp32[1:],  # a view 4 bytes into its storage
        torch.randn(1000, 1000, generator=gen).t(),  # non-contiguous
    )]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("gpu_from", [1, _gpucrc.GPU_FROM])
def test_pipeline_checksums_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_from: int) -> None:
    """read_spans into CUDA tensors returns crc32c of each tensor's bytes, whether checksummed on
    the GPU (the contiguous ones from gpu_from bytes: with 1, the edge cases too) or the host."""
    monkeypatch.setattr(_gpucrc, "GPU_FROM", gpu_from)
    device = torch.device("cuda")
    sources = _large_sources(device) + [case.source(device) for case in EDGE_CASES]
    spans, offset = [], 5
    for t in sources:
        spans.append(_pipeline.Span.of(t, offset))
        offset += t.numel() * t.element_size()
    expected = [crc(as_bytes(t)) for t in sources]
    path = tmp_path / "packed.bin"
    with _fileio.endpoint(path, None, writing=True) as ep:
        _pipeline.write_spans(ep, spans, Settings(buffer_size=1 << 20, num_buffers=3, io_threads=3))
    targets = [poisoned_like(t) for t in sources]
    targets[3] = poisoned_like(sources[2])[1:-2]  # 2 bytes into its storage: on the host
    assert sources[5]._base is not None
    targets[5] = poisoned_like(sources[5]._base)[1:]  # 4 bytes in: on the device
    into = [_pipeline.Span.of(t, s.offset) for t, s in zip(targets, spans, strict=True)]
    taken: list[int] = []
    real_crcs = _gpucrc.crcs

    def crcs(tensors: list[torch.Tensor]) -> list[int]:
        taken.extend(t.numel() for t in tensors)
        return real_crcs(tensors)

    monkeypatch.setattr(_gpucrc, "crcs", crcs)
    cfg = Settings(buffer_size=(2 << 20) + 7, num_buffers=4, io_threads=3)
    with _fileio.endpoint(path, 0, writing=False) as ep:
        assert _pipeline.read_spans(ep, into, cfg, checksum=True) == expected
    words = [s.nbytes for s, t in zip(spans, targets, strict=True)
             if t.is_contiguous() and s.nbytes >= gpu_from and s.nbytes % 4 == 0 and t.data_ptr() % 4 == 0]
    assert sorted(taken) == sorted(words) and len(taken) >= 3
    for target, source in zip(targets, sources, strict=True):
        assert_bytes_equal(target, source)


@pytest.mark.gpu
@needs_gpu
def test_corrupt_byte_found_on_the_device(tmp_path: Path) -> None:
    """A flipped bit deep inside a large tensor (checksummed on the GPU) is reported by name."""
    state = {"big": torch.randn(3 << 20, device="cuda"), "small": torch.randn(10, device="cuda")}
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    raw[8 + header_len + (5 << 20) + 123] ^= 0x10  # inside "big" (12 MiB, first in the data)
    path.write_bytes(bytes(raw))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(ckptstream.CorruptCheckpointError, match="big"):
        ckptstream.load_into(target, path)
    ckptstream.load_into(target, path, verify=False)  # the bytes themselves load


@pytest.mark.gpu
@needs_gpu
def test_failed_self_test_falls_back_to_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda")
    monkeypatch.setattr(_gpucrc, "_usable", {})

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(_gpucrc, "crcs", broken)
    with pytest.warns(RuntimeWarning, match="no kernel today"):
        assert not _gpucrc.usable(device)
    state = {"big": torch.randn(2 << 20, device=device)}
    path = tmp_path / "h.safetensors"
    ckptstream.save(state, path)
    out = ckptstream.load_into({"big": torch.empty_like(state["big"])}, path)
    assert torch.equal(out["big"], state["big"])
