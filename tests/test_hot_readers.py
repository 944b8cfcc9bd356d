"""A load whose file the page cache holds gets more readers (hot_io_threads, up to the cores),
the same staging split among them (into a GPU, where copies are queued by address, without the
interpreter lock; else the configured readers). The tensors arrive byte-exact either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream._engine import read, streams
from ckptstream._settings import Settings
from tests.streamsim import SimDevices


def spy_tune(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    chosen: list[Settings] = []
    tune = read.ReadEngine.tune

    def spy(self: read.ReadEngine, cfg: Settings, *args: object) -> Settings:
        chosen.append(tune(self, cfg, *args))  # type: ignore[arg-type]
        return chosen[-1]

    monkeypatch.setattr(read.ReadEngine, "tune", spy)
    return chosen


def test_a_hot_load_into_host_memory_gets_more_readers(tmp_path: Path, device: torch.device,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no more readers to give")
    gen = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(17 << 20, generator=gen), "b": torch.randint(-9, 9, (1001, 4099), generator=gen,
                                                                          dtype=torch.int16)}
    path = tmp_path / "hot.safetensors"
    ckptstream.save(state, path)
    with open(path, "rb") as f:  # in the page cache, whole
        while f.read(16 << 20):
            pass
    chosen = spy_tune(monkeypatch)
    with ckptstream.settings(io_threads=1, num_buffers=2, buffer_size=8 << 20, hot_io_threads=2):
        loaded = ckptstream.load(path, device=device, mmap=False)
    assert chosen
    assert chosen[-1].io_threads == 2, chosen
    assert chosen[-1].buffer_size * chosen[-1].num_buffers <= 16 << 20  # the same staging, split
    for name, t in state.items():
        assert loaded[name].device.type == device.type
        assert torch.equal(loaded[name].cpu(), t)


@pytest.mark.parametrize("by_address", [True, False], ids=["copies-by-address", "copies-through-torch"])
def test_a_hot_load_into_a_device_gets_more_readers_where_copies_skip_the_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_address: bool) -> None:
    """On the simulated GPU (tests/streamsim.py: device copies that run only when waited for):
    more readers where copies are queued by address; the configured readers where they go
    through torch. Tensors that split elements across the small chunks arrive exact."""
    gen = torch.Generator().manual_seed(11)
    state = {"a": torch.randn(300_001, generator=gen), "b": torch.randint(-9, 9, (513, 1027), generator=gen,
                                                                          dtype=torch.int16)}
    path = tmp_path / "hot.safetensors"
    ckptstream.save(state, path)
    path.read_bytes()  # in the page cache, whole
    sim = SimDevices(copies_by_address=by_address)
    monkeypatch.setattr(streams, "DEVICES", sim)
    monkeypatch.setattr(read, "HOT_FROM", 0)  # a hot load, whatever its size
    chosen = spy_tune(monkeypatch)
    cfg = Settings(io_threads=1, num_buffers=2, buffer_size=256 << 10, hot_io_threads=2, direct_io="off")
    loaded = ckptstream.load(path, mmap=False, settings=cfg, checksum=False)
    sim.drain()
    if (os.cpu_count() or 1) >= 2 and by_address:
        assert (chosen[-1].io_threads, chosen[-1].num_buffers, chosen[-1].buffer_size) == (2, 2, 256 << 10), chosen
    else:
        assert chosen[-1] == cfg, chosen
    assert (sim.copied_by_address > 0) == by_address
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name


@pytest.mark.gpu
def test_on_a_gpu_copies_go_by_address_through_the_runtime_torch_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA runtime is found among the process's libraries, a load into the GPU queues its
    copies through it (counted), and every byte arrives, in tensors cut across chunks."""
    from ckptstream._engine import cudart

    torch.empty(1, device="cuda")  # the runtime is loaded with torch's CUDA context
    assert cudart.runtime() is not None
    copied = []
    make = cudart.copier

    def counting(handle: int) -> cudart.Copier | None:
        copy = make(handle)
        assert copy is not None

        def count(dst: int, src: int, nbytes: int) -> None:
            copied.append(nbytes)
            copy(dst, src, nbytes)
        return count

    monkeypatch.setattr(cudart, "copier", counting)
    gen = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(1_000_003, generator=gen), "b": torch.randint(0, 255, (3, 777_777), generator=gen,
                                                                            dtype=torch.uint8)}
    path = tmp_path / "s.safetensors"
    ckptstream.save(state, path)
    loaded = ckptstream.load(path, device="cuda", settings=Settings(buffer_size=1 << 20, num_buffers=3))
    torch.cuda.synchronize()
    assert sum(copied) == sum(t.numel() * t.element_size() for t in state.values())
    for name, t in state.items():
        assert torch.equal(loaded[name].cpu(), t), name


def test_without_a_cuda_runtime_copies_go_through_torch() -> None:
    """Where no CUDA runtime is mapped in the process (a CPU build of torch, as here), nothing is
    copied by address: the engine's copies and its readers stay as configured (the fallback)."""
    from ckptstream._engine import cudart

    if torch.cuda.is_available():
        pytest.skip("a CUDA runtime is loaded here (the GPU test above covers that case)")
    assert cudart.runtime() is None
    assert cudart.copier(0) is None
    assert streams.CudaDevices().copies_by_address() is False
    mapped = "7f1c2a000000-7f1c2a0a1000 r-xp 00000000 08:01 123 "  # a line of /proc/self/maps, up to its path
    match = cudart._LIBRARY.search(mapped + "/opt/venv/nvidia/cu13/lib/libcudart.so.13\n")
    assert match is not None
    assert match.group(1) == "/opt/venv/nvidia/cu13/lib/libcudart.so.13"
    assert cudart._LIBRARY.search(mapped + "/usr/lib/libcudart_static.a\n") is None


def test_the_hot_check_samples_a_large_file_and_counts_every_page_of_a_small_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond SAMPLES x SAMPLE bytes the page-cache share is estimated from evenly spread
    windows (mincore over every page of a large file costs a good part of a hot load): with
    the second half of a file evicted, both ways tell a half."""
    from ckptstream._storage import fileio

    path = tmp_path / "half.bin"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 2 << 20, 0, os.POSIX_FADV_DONTNEED)
        exact = fileio.resident_fraction(fd, 0, 4 << 20)
        if exact != 0.5:
            pytest.skip(f"this file system keeps evicted pages (share {exact}): nothing to compare")
        looked: list[int] = []
        pages_in_memory = fileio.pages_in_memory

        def counted(address: int, nbytes: int) -> bytes | None:
            looked.append(nbytes)
            return pages_in_memory(address, nbytes)

        monkeypatch.setattr(fileio, "pages_in_memory", counted)
        monkeypatch.setattr(fileio, "SAMPLES", 8)
        monkeypatch.setattr(fileio, "SAMPLE", 64 << 10)
        assert fileio.resident_fraction(fd, 0, 4 << 20) == 0.5
        assert looked == [64 << 10] * 8  # 512 KiB of the 4 MiB looked at
        looked.clear()
        assert fileio.resident_fraction(fd, 0, 512 << 10) == 1.0  # within the samples: every page
        assert looked == [512 << 10]
    finally:
        os.close(fd)


@pytest.mark.parametrize("hot", [True, False], ids=["hot", "as-configured"])
def test_hot_readers_read_a_whole_chunk_per_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hot: bool) -> None:
    """From the page cache, each read call fills a whole staging buffer (every call gives the
    interpreter lock up and takes it back behind the other readers); the configured readers
    read in calls of READ_REQUEST, so that readahead runs on while a thread is busy. The
    tensors arrive byte-exact either way."""
    from ckptstream._storage import fileio, files

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no hot readers")
    gen = torch.Generator().manual_seed(13)
    state = {"a": torch.randn(5 << 20, generator=gen), "b": torch.randint(-9, 9, (3, 1_000_003), generator=gen,
                                                                          dtype=torch.int16)}
    path = tmp_path / "hot.safetensors"
    ckptstream.save(state, path)
    path.read_bytes()  # in the page cache, whole
    monkeypatch.setattr(read, "HOT_FROM", 0)
    calls: list[int] = []  # the most bytes each call of the loads' readers asks for (straight into the tensors)
    preadv_all = fileio.preadv_all

    def spy(fd: int, views: list[memoryview], offset: int, name: str, request: int | None = None) -> int:
        nbytes = sum(len(v) for v in views)
        calls.append(min(nbytes, request or nbytes))
        return preadv_all(fd, views, offset, name, request)

    monkeypatch.setattr(fileio, "preadv_all", spy)
    cfg = Settings(io_threads=1, num_buffers=2, buffer_size=8 << 20, hot_io_threads=2 if hot else 1, direct_io="off")
    loaded = ckptstream.load(path, mmap=False, settings=cfg, checksum=False)
    if hot:
        assert max(calls) == 8 << 20, calls  # the two readers' buffers of 8 MiB each, whole
    else:
        assert max(calls) == files.READ_REQUEST, calls
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name
