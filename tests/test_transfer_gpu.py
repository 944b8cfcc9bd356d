"""CUDA only (``pytest -m gpu``): ordering against the caller's stream, pinned staging buffers and
a round trip past 4 GiB. The CPU/CUDA round trips and error paths of test_transfer_*.py also run
on CUDA through the ``device`` fixture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine.buffers import POOL, StagingBuffer
from tests.helpers import POISON_BYTE, as_bytes, assert_bytes_equal, poisoned_like, random_tensor

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30
# torch.cuda._sleep spins one GPU thread for this many clock cycles: ~0.25-0.5 s at 1-2 GHz,
# far longer than the host needs to reach the device copies of a transfer
SLEEP_CYCLES = 500_000_000
MODES = ["explicit_stream", "current_stream", "default_stream"]


def caller_stream(mode: str) -> torch.cuda.Stream:
    """The stream the test's kernels run on: a side stream, or the default stream."""
    return torch.cuda.default_stream() if mode == "default_stream" else torch.cuda.Stream()


def save(mode: str, t: torch.Tensor, path: Path, s: torch.cuda.Stream) -> int:
    """device_to_file, told about ``s`` as the mode says: stream=s, or s made current."""
    if mode == "explicit_stream":
        return ckptstream.device_to_file(t, path, stream=s, settings=Settings(buffer_size=MiB))
    with torch.cuda.stream(s):
        return ckptstream.device_to_file(t, path, settings=Settings(buffer_size=MiB))


def load(mode: str, path: Path, t: torch.Tensor, s: torch.cuda.Stream) -> int:
    if mode == "explicit_stream":
        return ckptstream.file_to_device(path, t, stream=s, settings=Settings(buffer_size=MiB))
    with torch.cuda.stream(s):
        return ckptstream.file_to_device(path, t, settings=Settings(buffer_size=MiB))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("mode", MODES)
def test_save_waits_for_the_kernel_writing_the_tensor(tmp_path: Path, mode: str, layout: str) -> None:
    """A long kernel queued on the caller's stream writes the tensor; device_to_file called right
    after, without any synchronisation, must write the kernel's result, not the old contents."""
    expected = random_tensor((1024, 2048), torch.float32, "cuda")
    base = poisoned_like(expected if layout == "contiguous" else expected.t())
    t = base if layout == "contiguous" else base.t()
    torch.cuda.synchronize()
    s = caller_stream(mode)
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.copy_(expected)
    path = tmp_path / "t.bin"
    assert save(mode, t, path, s) == 8 * MiB
    assert path.read_bytes() == as_bytes(expected)
    torch.cuda.synchronize()


@pytest.mark.parametrize("mode", MODES)
def test_save_then_overwrite_on_the_callers_stream(tmp_path: Path, mode: str) -> None:
    """Work the caller queues after device_to_file returns (here: overwriting the tensor) must
    not leak into the file."""
    src = random_tensor(2 * MiB, torch.float32, "cuda")
    expected = as_bytes(src)
    torch.cuda.synchronize()
    s = caller_stream(mode)
    path = tmp_path / "t.bin"
    save(mode, src, path, s)
    with torch.cuda.stream(s):
        src.zero_()
    torch.cuda.synchronize()
    assert path.read_bytes() == expected


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("mode", MODES)
def test_load_is_seen_by_the_next_kernel(tmp_path: Path, mode: str, layout: str) -> None:
    """file_to_device, then at once a kernel on the caller's stream that reads the tensor: the
    kernel sees the file's data."""
    host = random_tensor((1024, 2048), torch.float32)
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(host, path)
    base = poisoned_like(torch.empty((1024, 2048) if layout == "contiguous" else (2048, 1024), device="cuda"))
    t = base if layout == "contiguous" else base.t()
    torch.cuda.synchronize()
    s = caller_stream(mode)
    assert load(mode, path, t, s) == 8 * MiB
    with torch.cuda.stream(s):
        seen = t * 1
    torch.cuda.synchronize()
    assert_bytes_equal(seen, host)


@pytest.mark.parametrize("mode", MODES)
def test_load_waits_for_earlier_work_on_the_destination(tmp_path: Path, mode: str) -> None:
    """Kernels queued before file_to_device that read and then write the destination: the read
    sees the old contents and the file's data overwrites the write (copies start after both)."""
    host = random_tensor(2 * MiB, torch.float32)
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(host, path)
    t = poisoned_like(torch.empty(host.shape, device="cuda"))
    torch.cuda.synchronize()
    s = caller_stream(mode)
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        old = t.clone()
        t.fill_(0.0)
    load(mode, path, t, s)
    with torch.cuda.stream(s):
        seen = t.clone()
    torch.cuda.synchronize()
    assert as_bytes(old) == bytes([POISON_BYTE]) * (8 * MiB)
    assert_bytes_equal(seen, host)


def test_staging_buffers_are_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device copies go through page-locked buffers (pageable memory is ~35x slower)."""
    used: list[StagingBuffer] = []
    real = POOL.acquire

    def spy(size: int, count: int, pinned: bool) -> list[StagingBuffer]:
        buffers = real(size, count, pinned)
        used.extend(buffers)
        return buffers

    monkeypatch.setattr(POOL, "acquire", spy)
    src = random_tensor(MiB, torch.float32, "cuda")
    ckptstream.device_to_file(src, tmp_path / "t.bin", settings=Settings(buffer_size=MiB, num_buffers=4))  # 4 chunks
    dst = poisoned_like(src)
    ckptstream.file_to_device(tmp_path / "t.bin", dst, settings=Settings(buffer_size=MiB, num_buffers=4))
    assert_bytes_equal(dst, src)
    assert len(used) == 8
    assert all(b.pinned and b.tensor.is_pinned() for b in used)


def test_round_trip_past_4_gib(tmp_path: Path) -> None:
    """More than 2^32 bytes (offsets and sizes past 32 bits), compared on the device in slices."""
    n = 4 * GiB + 4099
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    path = tmp_path / "big.bin"
    try:
        assert ckptstream.device_to_file(src, path) == n
        assert path.stat().st_size == n
        with open(path, "rb") as f:  # spot checks of the file itself: start, across 4 GiB, end
            for at in (0, 4 * GiB - 5000, n - 10000):
                f.seek(at)
                assert f.read(10000) == as_bytes(src[at : at + 10000])
        dst = torch.full_like(src, POISON_BYTE)
        assert ckptstream.file_to_device(path, dst) == n
    finally:
        path.unlink(missing_ok=True)  # 4 GiB: do not leave it to pytest's tmp retention
    step = 256 * MiB
    for i in range(0, n, step):
        assert torch.equal(dst[i : i + step], src[i : i + step]), f"bytes {i}..{i + step} differ"
