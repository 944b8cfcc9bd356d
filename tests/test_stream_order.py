"""Stream and event order, shown on the CPU through a simulated GPU (tests/streamsim.py).

Each test fails when the engine leaves out one wait that only a GPU's asynchronous copies
would expose: the I/O thread writing a staging buffer before its device-to-host copies ran,
the side stream not waiting for the kernels that produce the saved tensors, a staging buffer
refilled before its host-to-device copies ran, and the device checksums launched off the
copies' stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine import streams
from tests.streamsim import SimDevices

# small chunks, fewer buffers than chunks: every buffer is reused while copies are pending
SMALL: dict[str, Any] = {"buffer_size": 4096, "num_buffers": 2, "io_threads": 2}


@pytest.fixture(params=[True, False], ids=["by-address", "through-torch"])
def simulated_gpu(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[SimDevices]:
    """The simulated GPU, with host-to-device copies by address (the CUDA runtime found, see
    ``_engine.cudart``) and without (every copy through torch)."""
    sim = SimDevices(copies_by_address=request.param)
    monkeypatch.setattr(streams, "DEVICES", sim)
    yield sim
    sim.drain()


def _state() -> dict[str, torch.Tensor]:
    """Contiguous and non-contiguous tensors over several 4 KiB chunks, sizes that split elements,
    and runs of small tensors (moved in one copy and one gather or scatter per chunk)."""
    small = {f"s{i:03d}": torch.randn(i % 7 + 1) for i in range(300)}
    return {"big": torch.randn(5000), "odd": torch.randint(0, 255, (4099,), dtype=torch.uint8),
            "t": torch.randn(37, 29, dtype=torch.float64).t(), "h": torch.randn(3001, dtype=torch.float16), **small}


def _file_state(path: Path) -> dict[str, torch.Tensor]:
    """What the file holds, read through safetensors (no ckptstream code, no simulation)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def test_save_copies_after_the_callers_kernels_and_writes_after_the_copies(
        simulated_gpu: SimDevices, tmp_path: Path) -> None:
    final = _state()
    state = {k: torch.full_like(v, 3) for k, v in final.items()}  # what the tensors hold before the kernels
    for k, v in final.items():
        def kernel(k: str = k, v: torch.Tensor = v) -> None:
            state[k].copy_(v)

        simulated_gpu.producer(kernel)  # queued kernels produce the values
    path = tmp_path / "s.safetensors"
    ckptstream.save(state, path, settings=Settings(**SMALL))
    written = _file_state(path)
    for k, v in final.items():
        assert torch.equal(written[k], v.contiguous()), k


def test_device_to_file_writes_after_the_copies(simulated_gpu: SimDevices, tmp_path: Path) -> None:
    src = torch.randn(10_000).reshape(100, 100).t()
    ckptstream.device_to_file(src, tmp_path / "t.bin", settings=Settings(**SMALL))
    assert (tmp_path / "t.bin").read_bytes() == src.contiguous().numpy().tobytes()


def test_load_refills_a_buffer_only_after_its_copies_ran(simulated_gpu: SimDevices, tmp_path: Path) -> None:
    state = _state()
    with ckptstream.settings(**SMALL):
        simulated_gpu_save_plain(state, tmp_path / "s.safetensors")
        loaded = ckptstream.load(tmp_path / "s.safetensors", checksum=False)
        targets = {k: torch.full_like(v, 7) for k, v in state.items()}
        ckptstream.load_into(targets, tmp_path / "s.safetensors", checksum=False)
        dst = torch.empty(100, 100).t()
        src = torch.randn(100, 100).t()
        (tmp_path / "raw.bin").write_bytes(src.contiguous().numpy().tobytes())
        ckptstream.file_to_device(tmp_path / "raw.bin", dst)
    simulated_gpu.drain()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
        assert torch.equal(targets[k], v), k
    assert torch.equal(dst, src)
    # the path the parameter names was taken: most bytes by address, or none
    assert (simulated_gpu.copied_by_address > 2 * dst.numel()) == simulated_gpu.by_address


def test_device_checksums_run_after_the_copies(simulated_gpu: SimDevices, tmp_path: Path) -> None:
    state = _state()
    simulated_gpu_save_plain(state, tmp_path / "s.safetensors")
    with ckptstream.settings(**SMALL):
        # through the engine (not a mapping); raises CorruptCheckpointError when they run too early
        loaded = ckptstream.load(tmp_path / "s.safetensors", mmap=False)
        ckptstream.verify(tmp_path / "s.safetensors")
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def simulated_gpu_save_plain(state: dict[str, torch.Tensor], path: Path) -> None:
    """A checkpoint written with every copy immediate (the simulator set aside)."""
    saved = streams.DEVICES
    streams.DEVICES = streams.CudaDevices()
    try:
        ckptstream.save(state, path)
    finally:
        streams.DEVICES = saved


SLEEP_CYCLES = 500_000_000  # a kernel spinning far longer than the host needs to queue the copies


@pytest.mark.gpu
def test_runs_of_small_cuda_tensors_keep_stream_order(tmp_path: Path) -> None:
    """On a real GPU: many small tensors (moved in one copy and one gather or scatter kernel per
    chunk) written by kernels queued just before the save, and read by a kernel queued just
    after the load, with checksums verified on the way."""
    shapes = [(i % 13 + 1, 3) for i in range(3000)]
    expected = {f"s{i:04d}": torch.randn(shape, device="cuda") for i, shape in enumerate(shapes)}
    state = {k: torch.full_like(v, 3.0) for k, v in expected.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for k, v in expected.items():
        state[k].copy_(v)  # queued behind the spinning kernel
    path = tmp_path / "small.safetensors"
    ckptstream.save(state, path, settings=Settings(buffer_size=64 << 10, num_buffers=3))
    written = _file_state(path)
    assert all(torch.equal(written[k], v.cpu()) for k, v in expected.items())
    targets = {k: torch.full_like(v, 7.0) for k, v in expected.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # earlier work on the destinations: the load must not overtake it
    for t in targets.values():
        t.fill_(5.0)
    ckptstream.load_into(targets, path, settings=Settings(buffer_size=64 << 10, num_buffers=3))
    seen = {k: t * 1 for k, t in targets.items()}  # at once, on the caller's stream
    loaded = ckptstream.load(path, device="cuda", settings=Settings(buffer_size=64 << 10, num_buffers=3))
    seen_loaded = {k: t * 1 for k, t in loaded.items()}
    torch.cuda.synchronize()
    for k, v in expected.items():
        assert torch.equal(seen[k], v), k
        assert torch.equal(seen_loaded[k], v), k


def test_the_staging_pool_keeps_one_kind_of_buffer(tmp_path: Path) -> None:
    """Staging stays num_buffers x buffer_size: transfers with other settings (a hot load splits
    the same staging into smaller buffers) do not leave the first ones idle in the pool."""
    ckptstream.release_staging()
    src = torch.randn(200_000)
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(src, path, settings=Settings(buffer_size=64 << 10, num_buffers=4, direct_io="off"))
    assert ckptstream.staging_bytes() == 4 * (64 << 10)
    dst = torch.empty(400, 500).t()  # not contiguous: staged
    ckptstream.file_to_device(path, dst, settings=Settings(buffer_size=32 << 10, num_buffers=8))
    assert ckptstream.staging_bytes() == 8 * (32 << 10)
    assert torch.equal(dst.reshape(-1), src)
