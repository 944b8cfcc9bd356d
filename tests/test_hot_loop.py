"""The native loop of a hot load into a GPU (``_engine/hotloop.c``): an I/O thread's range of
chunks in one call, without the interpreter lock. On the simulated GPU (tests/streamsim.py),
whose copies run only when waited for, so that a buffer refilled before its copies ran shows
as wrong bytes; the C loop itself is the one a GPU runs, only its CUDA calls are simulated."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._engine import control, hotloop, read, streams
from ckptstream._settings import Settings
from tests.streamsim import SimDevices, SimStream

needs_loop = pytest.mark.skipif(hotloop.LIBRARY is None, reason="the native loop is not built (setup.py)")
HOT = Settings(io_threads=1, num_buffers=4, buffer_size=64 << 10, hot_io_threads=2, direct_io="off")


def hot_file(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "hot.safetensors"
    ckptstream.save(state, path)
    path.read_bytes()  # in the page cache, whole
    return path


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> SimDevices:
    devices = SimDevices()
    monkeypatch.setattr(streams, "DEVICES", devices)
    monkeypatch.setattr(read, "HOT_FROM", 0)  # a hot load, whatever its size
    return devices


def big_state() -> dict[str, torch.Tensor]:
    """Contiguous tensors whose sizes cut elements across the 32 KiB chunks of each reader."""
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randn(100_003, generator=gen), "b": torch.randint(-99, 99, (333, 1031), generator=gen,
                                                                         dtype=torch.int16),
            "c": torch.randn(77, 513, generator=gen, dtype=torch.float64), "d": torch.empty(0)}


@needs_loop
@pytest.mark.parametrize("checksum", [True, False])
def test_a_hot_load_moves_every_byte_through_the_native_loop(tmp_path: Path, sim: SimDevices, checksum: bool) -> None:
    state = big_state()
    path = hot_file(tmp_path, state)
    loaded = ckptstream.load(path, mmap=False, settings=HOT, checksum=checksum)
    sim.drain()
    if (os.cpu_count() or 1) >= 2:
        assert sim.native_calls >= 2, "the readers did not take the native loop"
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name


@needs_loop
def test_ranges_the_loop_cannot_move_take_the_python_loop_in_the_same_load(
        tmp_path: Path, sim: SimDevices, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor that the (simulated) device does not checksum is checksummed from the staging
    buffer: its reader's range keeps the Python loop, the other reader's goes native. A
    non-contiguous target keeps the Python loop for every range (turns in file order)."""
    state = big_state()
    state["zz"] = torch.randn(5)
    path = hot_file(tmp_path, state)
    monkeypatch.setattr(sim, "span_checksums_on_device", lambda memory, begins, ends: len(begins) > 1)
    moved: list[object] = []
    move = read.ReadEngine._move

    def spy(self: read.ReadEngine, chunk: Any, buf: Any) -> None:
        moved.append(chunk)
        move(self, chunk, buf)

    monkeypatch.setattr(read.ReadEngine, "_move", spy)
    targets = {k: torch.full_like(v, -7) for k, v in state.items()}
    ckptstream.load_into(targets, path, settings=HOT)
    sim.drain()
    if (os.cpu_count() or 1) >= 2:
        assert sim.native_calls == 1, "the range of large tensors did not take the native loop"
    assert moved, "the range of small tensors did not take the Python loop"
    for name, t in state.items():
        assert torch.equal(targets[name], t), name
    targets = {k: torch.full_like(v, -7) for k, v in state.items()}
    targets["c"] = torch.full((513, 77), -7.0, dtype=torch.float64).t()
    calls = sim.native_calls
    ckptstream.load_into(targets, path, settings=HOT)
    sim.drain()
    assert sim.native_calls == calls
    for name, t in state.items():
        assert torch.equal(targets[name], t), name


@needs_loop
def test_without_the_built_loop_the_python_loop_moves_the_same_bytes(tmp_path: Path, sim: SimDevices,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hotloop, "LIBRARY", None)
    state = big_state()
    loaded = ckptstream.load(hot_file(tmp_path, state), mmap=False, settings=HOT)
    sim.drain()
    assert sim.native_calls == 0
    assert sim.copied_by_address > 0
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name


def _one_call(tmp_path: Path, data: bytes, chunks: list[tuple[int, int, int, int]], *, fd: int | None = None,
              stop: int = 0, fail: str = "") -> tuple[hotloop.Result, torch.Tensor, Any]:
    """``hotloop.run`` over a file holding ``data``, into one destination (chunk by chunk, one
    part each, in two staging buffers), on a simulated stream."""
    path = tmp_path / "raw"
    path.write_bytes(data)
    sim, stream = SimDevices(), SimStream("side")
    calls = sim.native(stream, 2)
    if fail:
        bad = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                               ctypes.c_void_p)(lambda *a: 700)
        calls.memcpy_async, calls.keep = ctypes.cast(bad, ctypes.c_void_p).value, (calls.keep, bad)
    dst = torch.full((len(data),), 0xEE, dtype=torch.uint8)
    buffers = [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(2)]
    parts = [[(c[1], dst.data_ptr() + c[0], c[2])] for c in chunks]
    own = fd if fd is not None else os.open(path, os.O_RDONLY)
    try:
        result = hotloop.run(own, [b.data_ptr() for b in buffers], calls, chunks, parts, ctypes.c_int32(stop))
    finally:
        if fd is None:
            os.close(own)
    stream.synchronize()
    return result, dst, calls


@needs_loop
def test_the_loop_waits_for_a_buffers_copies_before_refilling_it(tmp_path: Path) -> None:
    """Five chunks through two buffers, the copies run only when waited for: every byte right
    only if each refill waited for the copies out of that buffer."""
    data = os.urandom(5 * 40_000 + 123)
    chunks = [(o, 0, min(40_000, len(data) - o), min(40_000, len(data) - o)) for o in range(0, len(data), 40_000)]
    result, dst, _ = _one_call(tmp_path, data, chunks)
    assert (result.status, result.moved) == (hotloop.OK, len(data))
    assert dst.numpy().tobytes() == data


@needs_loop
def test_a_file_shorter_than_its_chunks_says_where_it_ends(tmp_path: Path) -> None:
    data = os.urandom(70_001)
    result, _, _ = _one_call(tmp_path, data, [(0, 0, 40_000, 40_000), (40_000, 0, 40_000, 40_000)])
    assert (result.status, result.chunk, result.file_end) == (hotloop.SHORT, 1, 70_001)


@needs_loop
def test_read_and_copy_errors_and_a_stop_are_raised_as_the_python_loop_raises_them(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    one = [(0, 0, 50_000, 50_000)]
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        result, _, calls = _one_call(tmp_path, data, one, fd=directory)
    finally:
        os.close(directory)
    with pytest.raises(IsADirectoryError, match="reading 50000 bytes at offset 0") as caught:
        result.check(str(tmp_path / "raw"), one[0], calls)
    assert caught.value.filename == str(tmp_path / "raw")
    result, dst, calls = _one_call(tmp_path, data, one, fail="copy")
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync failed .* \(700\)"):
        result.check("f", one[0], calls)
    result, dst, calls = _one_call(tmp_path, data, one, stop=1)
    assert (result.status, result.moved) == (hotloop.STOPPED, 0)
    with pytest.raises(control.Stopped):
        result.check("f", one[0], calls)
    assert dst.unique().tolist() == [0xEE], "a stopped loop moved bytes"


@needs_loop
@pytest.mark.gpu
def test_on_a_gpu_a_hot_load_takes_the_native_loop_and_checks_every_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, through the runtime torch loaded: every reader's range in calls of the native
    loop (counted), the checksums of tensors complete between calls launched meanwhile, the
    bytes exact, and a corrupted tensor named by its checksum."""
    from ckptstream.errors import CorruptCheckpointError
    from tests.helpers import flip_last_byte

    monkeypatch.setattr(read, "HOT_FROM", 0)
    monkeypatch.setattr(read, "SEGMENT_FROM", 64 << 10)  # several calls per reader, checksums launched between
    calls, run = [], hotloop.run

    def counting(*args: Any) -> hotloop.Result:
        result = run(*args)
        calls.append(result.moved)
        return result

    monkeypatch.setattr(hotloop, "run", counting)
    gen = torch.Generator().manual_seed(4)  # whole 32-bit words, which the device checksums take
    state = {"a": torch.randn(100_003, generator=gen), "a_bias": torch.randn(7, generator=gen),
             "b": torch.randint(-99, 99, (333, 1032), generator=gen, dtype=torch.int16),
             "c": torch.randn(77, 513, generator=gen, dtype=torch.float64), "d": torch.empty(0)}
    path = hot_file(tmp_path, state)
    cfg = Settings(io_threads=1, num_buffers=4, buffer_size=64 << 10, hot_io_threads=4, direct_io="off")
    loaded = ckptstream.load(path, device="cuda", settings=cfg)
    torch.cuda.synchronize()
    assert len(calls) >= min(4, os.cpu_count() or 1), calls
    for name, t in state.items():
        assert loaded[name].is_cuda
        assert torch.equal(loaded[name].cpu(), t), name
    flip_last_byte(path, "b")
    path.read_bytes()
    with pytest.raises(CorruptCheckpointError, match=r"'b'.*CRC-32C|b.*CRC-32C"):
        ckptstream.load(path, device="cuda", settings=cfg)


@pytest.mark.parametrize("into", [False, True], ids=["load", "load_into"])
def test_tensors_too_small_for_the_whole_tensor_kernel_are_checked_by_the_span_kernel(
        tmp_path: Path, sim: SimDevices, monkeypatch: pytest.MonkeyPatch, into: bool) -> None:
    """Lone small tensors between large ones go in the one launch of the span kernel (so no
    reader's range keeps a checksum on the host), each value where its tensor's belongs: a
    corrupted one is named."""
    from ckptstream._checkpoint import blocks
    from ckptstream.errors import CorruptCheckpointError
    from tests.helpers import flip_last_byte

    monkeypatch.setattr(blocks, "BLOCK", 16 << 10)  # on the simulated (CPU) device: as a GPU's 1 MiB
    state = {"a": torch.randn(8001), "a_bias": torch.randn(7), "b": torch.randn(9000), "b_bias": torch.randn(5),
             "c": torch.randn(8500)}
    path = hot_file(tmp_path, state)
    spans: list[int] = []
    launch = sim.span_checksums

    def counting(runs: Any) -> Any:
        spans.extend(len(begins) for _, begins, _ in runs)
        return launch(runs)

    monkeypatch.setattr(sim, "span_checksums", counting)

    def load() -> dict[str, torch.Tensor]:
        if not into:
            return ckptstream.load(path, mmap=False, settings=HOT)
        targets = {k: torch.full_like(v, -7) for k, v in state.items()}
        ckptstream.load_into(targets, path, settings=HOT)
        return targets

    loaded = load()
    sim.drain()
    assert spans.count(1) >= 2, f"the lone small tensors were not checksummed by the span kernel: {spans}"
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name
    flip_last_byte(path, "b_bias")
    path.read_bytes()
    with pytest.raises(CorruptCheckpointError, match="b_bias"):
        load()


@needs_loop
@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
def test_checksums_of_tensors_complete_between_calls_are_launched_while_the_load_runs(
        tmp_path: Path, sim: SimDevices, monkeypatch: pytest.MonkeyPatch, corrupt: bool) -> None:
    """Each reader moves its range in several calls and, after each, launches the checksums of
    the tensors whose every part is queued by then, by any reader: each tensor once, after all
    its copies (the simulated copies run only when waited for, so a checksum launched before
    another reader queued its part of the tensor sees the poisoned bytes and fails the load).
    A corrupted tensor is named as at the end."""
    from ckptstream.errors import CorruptCheckpointError
    from tests.helpers import flip_last_byte

    monkeypatch.setattr(read, "SEGMENT_FROM", 64 << 10)  # several calls per reader
    state = big_state()
    path = hot_file(tmp_path, state)
    launched: list[tuple[bool, list[int]]] = []  # (from an I/O thread, the pieces)
    launch = read.ReadEngine._launch_checksums

    def spy(self: read.ReadEngine, pieces: Any) -> Any:
        launched.append((threading.current_thread() is not threading.main_thread(), list(pieces)))
        return launch(self, pieces)

    monkeypatch.setattr(read.ReadEngine, "_launch_checksums", spy)
    if corrupt:
        flip_last_byte(path, "b")  # "b" is cut between the two readers' ranges
        path.read_bytes()
        with pytest.raises(CorruptCheckpointError, match="'b'"):
            ckptstream.load(path, mmap=False, settings=HOT)
        return
    targets = {k: torch.full_like(v, -7) for k, v in state.items()}
    ckptstream.load_into(targets, path, settings=HOT)
    sim.drain()
    for name, t in state.items():
        assert torch.equal(targets[name], t), name
    pieces = [i for _, its in launched for i in its]
    assert len(pieces) == len(set(pieces)), f"a checksum launched twice: {launched}"
    assert len(pieces) == 3, launched  # a, b and c (d is empty)
    if (os.cpu_count() or 1) >= 2:
        assert any(early and its for early, its in launched), f"nothing launched while the load ran: {launched}"
