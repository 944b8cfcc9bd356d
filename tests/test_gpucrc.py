"""CRC-32C on the GPU (``_engine.gpucrc``): the kernel equals crc32c on any length and start, loads that
verify into CUDA tensors checksum large pieces there and still catch every corrupt byte, and the
host path takes over where the kernel cannot run."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import ckptstream
from ckptstream import Settings, _checksum
from ckptstream._engine import Piece, ReadEngine, WriteEngine, gpucrc
from ckptstream._storage import local
from ckptstream._storage.files import FileSink, FileSource
from tests.helpers import EDGE_CASES, as_bytes, assert_bytes_equal, flip_last_byte, packed_pieces, poisoned_like


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
        assert gpucrc.finish(register, n) == crc(data)


def test_tables_multiply_the_register_by_a_constant() -> None:
    assert gpucrc._times(_checksum.shift(1))[1] == 0xF26B8303  # the published CRC-32C byte table
    rng = random.Random(6)
    for constant in (_checksum.shift(4 * gpucrc.LANES), rng.getrandbits(32)):
        tables = gpucrc._times(constant)
        for r in (1, 0xFFFFFFFF, *(rng.getrandbits(32) for _ in range(50))):
            looked_up = 0
            for k in range(4):
                looked_up ^= tables[k * 256 + (r >> (8 * k) & 0xFF)]
            assert looked_up == _checksum.multiply(r, constant)


def test_host_only_without_cuda() -> None:
    assert not gpucrc.usable(torch.device("cpu"))


def test_host_without_torchs_kernel_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch before 2.8 has no loader for NVRTC kernels: the host checksums, without a warning."""
    from torch.cuda import _utils

    monkeypatch.delattr(_utils, "_cuda_load_module", raising=False)
    assert gpucrc._built(torch.device("cuda", 0)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_kernel_equals_crc32c(seed: int) -> None:
    """Lengths around the lane and block sizes and random ones, 4-byte aligned starts (what
    ``eligible`` admits), many tensors per launch."""
    device = torch.device("cuda")
    assert gpucrc.usable(device)
    rng = random.Random(seed)
    data = torch.randint(0, 256, (5 * gpucrc.BLOCK + 4096,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    on_gpu = data.to(device)
    lengths = [4, 8, 252, 256, 260, gpucrc.BLOCK - 4, gpucrc.BLOCK, gpucrc.BLOCK + 4,
               *(4 * rng.randrange(1, 5 * gpucrc.BLOCK // 4) for _ in range(20))]
    starts = [4 * rng.randrange(0, 1000) for _ in lengths]
    got = gpucrc.crcs([on_gpu[a : a + n] for a, n in zip(starts, lengths, strict=True)])
    assert got == [crc(data[a : a + n].numpy().tobytes()) for a, n in zip(starts, lengths, strict=True)]
    assert gpucrc.crcs([on_gpu[:-4]]) == [crc(data[:-4].numpy().tobytes())]


def kernel_in_python(words: list[int], consts: list[int], lanes: int, per_lane: int, shifts: int) -> int:
    """What crc32c_blocks computes for one tensor of 32-bit ``words``, step by step as in its
    CUDA source, reading ``consts`` at the same places (the source's own test is on the GPU)."""
    n, register = len(words), 0
    blocks = -(-n // (lanes * per_lane))
    for block in range(blocks):
        value = 0
        for lane in range(lanes):
            start = (block - blocks) * lanes * per_lane + n + lane
            r = 0
            for j in range(per_lane):
                at = start + j * lanes
                word = words[at] if at >= 0 else 0
                r = (consts[r & 255] ^ consts[256 + (r >> 8 & 255)] ^ consts[512 + (r >> 16 & 255)]
                     ^ consts[768 + (r >> 24)] ^ word)
            value ^= _checksum.multiply(r, consts[1024 + lane])
        after = blocks - 1 - block
        value = _checksum.multiply(value, consts[1024 + lanes + after % shifts])
        register ^= _checksum.multiply(value, consts[1024 + lanes + shifts + after // shifts])
    return register


@pytest.mark.parametrize("nwords", [1, 63, 64, 65, 200, 777])
def test_kernel_arithmetic_gives_the_crc(monkeypatch: pytest.MonkeyPatch, nwords: int) -> None:
    """The kernel's steps with the module's constants, on a small block shape (8 lanes x 8 words,
    shifts in two steps of 4): lengths within a block and across up to 13, padding in front."""
    monkeypatch.setattr(gpucrc, "LANES", 8)
    monkeypatch.setattr(gpucrc, "BLOCK", 8 * 8 * 4)
    monkeypatch.setattr(gpucrc, "_SHIFTS", 4)
    data = random.Random(nwords).randbytes(4 * nwords)
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
    register = kernel_in_python(words, gpucrc._constants(), 8, 8, 4)
    assert gpucrc.finish(register, len(data)) == crc(data)


@pytest.mark.parametrize("nwords", [1, 7, 8, 255, 256, 257, 700])
def test_span_instance_arithmetic_gives_the_crc(nwords: int) -> None:
    """The kernel's steps with the constants of its instance for spans (a warp x 8 words)."""
    data = random.Random(nwords + 1).randbytes(4 * nwords)
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
    consts = gpucrc._constants(gpucrc.SPAN_LANES, gpucrc.SPAN_BLOCK)
    register = kernel_in_python(words, consts, gpucrc.SPAN_LANES, gpucrc.SPAN_WORDS, gpucrc._SHIFTS)
    assert gpucrc.finish(register, len(data)) == crc(data)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_span_kernel_equals_crc32c(seed: int) -> None:
    """Byte ranges of one allocation, back to back and with gaps, around the span block size, and
    many of them in one launch; ranges of equal length share the finishing term."""
    device = torch.device("cuda")
    assert gpucrc.usable(device)
    rng = random.Random(seed)
    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    lengths = [4, 8, 124, 128, 132, gpucrc.SPAN_BLOCK - 4, gpucrc.SPAN_BLOCK, gpucrc.SPAN_BLOCK + 4,
               *(1024 for _ in range(3000)), *(4 * rng.randrange(1, 4000) for _ in range(40))]
    rng.shuffle(lengths)
    begins, at = [], 4 * rng.randrange(0, 8)
    for n in lengths:
        begins.append(at)
        at += n + 4 * rng.choice((0, 0, 1, 5))
    assert at <= data.numel()
    ends = [b + n for b, n in zip(begins, lengths, strict=True)]
    on_gpu = data.to(device)
    assert gpucrc.spans_eligible(on_gpu, begins, ends)
    got = gpucrc.span_crcs(on_gpu, begins, ends)
    assert got == [crc(data[b:e].numpy().tobytes()) for b, e in zip(begins, ends, strict=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("buffer_size", [4096, 16 << 20], ids=["4k", "16m"])
def test_whole_load_checksums_small_tensors_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         buffer_size: int) -> None:
    """A whole load into a GPU moves runs of small tensors as one piece each and checksums each
    tensor of them on the device, every run's in one launch: every value exact, a corrupt byte
    named by its own tensor, chunks that cut the runs or not."""
    launches: list[int] = []
    real = gpucrc.launch_spans

    def counted(runs: list[gpucrc.Spans]) -> gpucrc.Waiter:
        launches.append(sum(len(begins) for _, begins, _ in runs))
        return real(runs)

    monkeypatch.setattr(gpucrc, "launch_spans", counted)
    gen = torch.Generator(device="cuda").manual_seed(3)
    # runs of 499 small tensors between tensors of their own allocation (1 MiB and more)
    state = {f"t{i:04d}": torch.randn(i % 50 + 1 if i % 500 else (1 << 18) + i, device="cuda", generator=gen)
             for i in range(3000)}
    small = [k for k, v in state.items() if v.numel() * 4 < gpucrc.GPU_FROM]
    path = tmp_path / "small.safetensors"
    ckptstream.save(state, path)
    loaded = ckptstream.load(path, device="cuda", settings=ckptstream.Settings(buffer_size=buffer_size))
    assert launches == [len(small)]
    for k, v in state.items():
        assert_bytes_equal(loaded[k], v)
    flip_last_byte(path, "t1234")
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"'t1234' fails its CRC-32C"):
        ckptstream.load(path, device="cuda", settings=ckptstream.Settings(buffer_size=buffer_size))


@pytest.mark.gpu
def test_kernels_build_beside_a_load_and_no_thread_outlives_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load into a GPU builds the kernels on a thread of its own while it reads the
    header; the load joins it, also when it fails before reading a byte."""
    builders: list[str] = []
    real = gpucrc._built

    def built(device: torch.device) -> Any:
        builders.append(threading.current_thread().name)
        return real(device)

    monkeypatch.setattr(gpucrc, "_built", built)
    path, bad = tmp_path / "s.safetensors", tmp_path / "bad.safetensors"
    state = {f"w{i}": torch.randn(100 + i, device="cuda") for i in range(50)}
    ckptstream.save(state, path)
    bad.write_bytes(path.read_bytes()[:-1])
    for load, target in ((_load_gpu, path), (_load_gpu, bad), (_load_into_gpu, path)):
        monkeypatch.setattr(gpucrc, "_kernels", {})  # as in a new process
        builders.clear()
        try:
            loaded = load(target)
        except ckptstream.CorruptCheckpointError:
            assert target == bad
        else:
            for k, v in state.items():
                assert_bytes_equal(loaded[k], v)
        assert builders == ["ckptstream-crc-build"]
        assert not [t for t in threading.enumerate() if t.name == "ckptstream-crc-build"]


def _load_gpu(path: Path) -> Any:
    return ckptstream.load(path, device="cuda")


def _load_into_gpu(path: Path) -> Any:
    state = ckptstream.load(path, device="meta")
    targets = {k: torch.empty_like(v, device="cuda") for k, v in state.items()}
    ckptstream.load_into(targets, path)
    return targets


def test_spans_eligible() -> None:
    memory = torch.empty(4096, dtype=torch.uint8)
    assert gpucrc.spans_eligible(memory, [0, 8, 100], [8, 100, 104])
    assert not gpucrc.spans_eligible(memory, [], [])
    assert not gpucrc.spans_eligible(memory[2:], [0], [8])  # unaligned memory
    assert not gpucrc.spans_eligible(memory, [0, 10], [8, 14])  # an unaligned range
    assert not gpucrc.spans_eligible(memory, [0, 8], [8, 14])  # not whole words
    assert not gpucrc.spans_eligible(memory, [0, 8], [8, 8])  # empty


def test_eligible_bytes() -> None:
    base = torch.empty(4 << 20, dtype=torch.uint8)
    assert gpucrc.eligible(base)
    assert gpucrc.eligible(base[4:])
    assert not gpucrc.eligible(base[2:-2])  # unaligned start
    assert not gpucrc.eligible(base[:-2])  # not whole words
    assert not gpucrc.eligible(base[: gpucrc.GPU_FROM - 4])  # small: on the host


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
@pytest.mark.parametrize("gpu_from", [1, gpucrc.GPU_FROM])
def test_engine_checksums_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_from: int) -> None:
    """A read engine into CUDA tensors returns crc32c of each tensor's bytes, whether checksummed on
    the GPU (the contiguous ones from gpu_from bytes: with 1, the edge cases too) or the host."""
    monkeypatch.setattr(gpucrc, "GPU_FROM", gpu_from)
    device = torch.device("cuda")
    sources = _large_sources(device) + [case.source(device) for case in EDGE_CASES]
    pieces = packed_pieces(sources, 5)
    expected = [crc(as_bytes(t)) for t in sources]
    path = tmp_path / "packed.bin"
    with local.opened(path, None, FileSink) as (file, _):
        WriteEngine(file, pieces, Settings(buffer_size=1 << 20, num_buffers=3, io_threads=3)).run()
    targets = [poisoned_like(t) for t in sources]
    targets[3] = poisoned_like(sources[2])[1:-2]  # 2 bytes into its storage: on the host
    assert sources[5]._base is not None
    targets[5] = poisoned_like(sources[5]._base)[1:]  # 4 bytes in: on the device
    into = [Piece.of(t, p.offset) for t, p in zip(targets, pieces, strict=True)]
    taken: list[int] = []
    real_launch = gpucrc.launch

    def launch(tensors: list[torch.Tensor]) -> gpucrc.Waiter:
        taken.extend(t.numel() for t in tensors)
        return real_launch(tensors)

    monkeypatch.setattr(gpucrc, "launch", launch)
    cfg = Settings(buffer_size=(2 << 20) + 7, num_buffers=4, io_threads=3)
    with local.opened(path, 0, FileSource) as (reading, _):
        assert ReadEngine(reading, into, cfg, checksum=True).run() == expected
    words = [p.nbytes for p, t in zip(pieces, targets, strict=True)
             if t.is_contiguous() and p.nbytes >= gpu_from and p.nbytes % 4 == 0 and t.data_ptr() % 4 == 0]
    assert sorted(taken) == sorted(words)
    assert len(taken) >= 3
    for target, source in zip(targets, sources, strict=True):
        assert_bytes_equal(target, source)


@pytest.mark.gpu
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
    ckptstream.load_into(target, path, checksum=False)  # the bytes themselves load


@pytest.mark.gpu
def test_failed_self_test_falls_back_to_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that fails, or that computes wrong values, is found by the self-test: a warning,
    then loads checksum on the host."""
    device = torch.device("cuda")
    monkeypatch.setattr(gpucrc, "_kernels", {})
    real_crcs = gpucrc.crcs

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(gpucrc, "crcs", broken)
    with pytest.warns(RuntimeWarning, match="no kernel today"):
        assert not gpucrc.usable(device)
    assert not gpucrc.usable(device)  # tried once
    monkeypatch.setattr(gpucrc, "_kernels", {})
    monkeypatch.setattr(gpucrc, "crcs", lambda tensors: [c ^ 1 for c in real_crcs(tensors)])
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert not gpucrc.usable(device)
    state = {"big": torch.randn(2 << 20, device=device)}
    path = tmp_path / "h.safetensors"
    ckptstream.save(state, path)
    out = ckptstream.load_into({"big": torch.empty_like(state["big"])}, path)
    assert torch.equal(out["big"], state["big"])
