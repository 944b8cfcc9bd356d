"""Failures inside the streaming engine: an I/O error in an I/O thread after k chunks, a
failing device copy, a KeyboardInterrupt (raised by a copy in an I/O thread, or delivered
asynchronously to the caller while it waits for the I/O threads, or while they start).

Each must reach the caller within 5 s, with the I/O threads joined, the staging buffers back in
the pool, no descriptor left open, no temp file left and the previous checkpoint untouched;
after 100 failing transfers the descriptors, threads and RSS are what they were before.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import DirectIO, Settings
from ckptstream._engine import ReadEngine, WriteEngine
from ckptstream._engine import read as read_engine
from ckptstream._engine.engine import Engine
from ckptstream._storage import fileio
from tests.helpers import needs_ctrl_c
from tests.reliability.relutil import (
    KiB,
    MiB,
    all_temp_files,
    assert_released,
    assert_same_state,
    fd_count,
    settled_rss_kib,
    small_state,
)

READ_CALLS = ("pread_into", "preadv_all")  # staged chunks, and chunks read straight into host tensors
REACH_CALLER_S = 5.0
SMALL = Settings(buffer_size=64 * KiB, num_buffers=2)  # ~32 chunks per MiB: failures land mid-stream


def small(direct_io: DirectIO | str | bool | None) -> ckptstream.Settings:
    """``SMALL`` with ``direct_io``."""
    return Settings(buffer_size=64 * KiB, num_buffers=2, direct_io=direct_io)


def big_state(device: str = "cpu", mib: int = 2) -> dict[str, Any]:
    n = mib * MiB // 4
    return {
        "w": torch.arange(n // 2, dtype=torch.float32, device=device),
        "v": torch.arange(n // 2, dtype=torch.int32, device=device).view(-1, 8).t(),  # not contiguous
        "step": 3,
    }


def in_io_thread() -> bool:
    """Whether this is one of the engines' own threads (the tests themselves run in the main one)."""
    return threading.current_thread() is not threading.main_thread()


@contextlib.contextmanager
def fail_in_io_thread(monkeypatch: pytest.MonkeyPatch, names: str | tuple[str, ...], after: int,
                      fail: Callable[[], None]) -> Iterator[list[int]]:
    """Make ``fileio.<name>`` (any of ``names``, counted together) call ``fail()`` on its
    (after+1)-th call from an I/O thread."""
    names = (names,) if isinstance(names, str) else names
    originals = {name: getattr(fileio, name) for name in names}
    calls = [0]
    lock = threading.Lock()

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if in_io_thread():
                with lock:
                    calls[0] += 1
                    n = calls[0]
                if n == after + 1:
                    fail()
            return original(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        monkeypatch.setattr(fileio, name, wrap(original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            monkeypatch.setattr(fileio, name, original)


def eio() -> None:
    raise OSError(errno.EIO, "injected I/O error")


def enospc() -> None:
    raise OSError(errno.ENOSPC, "injected: no space left on device")


@contextlib.contextmanager
def reaches_caller(expected: type[BaseException] | tuple[type[BaseException], ...]) -> Iterator[None]:
    t0 = time.monotonic()
    with pytest.raises(expected):
        yield
    assert time.monotonic() - t0 < REACH_CALLER_S


@pytest.fixture
def old_checkpoint(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    """A checkpoint to save over; afterwards checks that it and its directory are untouched."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(small_state(1), path)
    before = path.read_bytes()
    ckptstream.load(path)  # warm up: lazily opened descriptors do not count below
    yield path, before
    assert path.read_bytes() == before, "a failed save changed the previous checkpoint"
    assert all_temp_files(tmp_path) == [], "a failed save left a temp file"


# --- I/O errors in the I/O threads --------------------------------------------------------------


@pytest.mark.parametrize("after", [0, 1, 7])
@pytest.mark.parametrize("direct_io", [None, False])
def test_write_error_in_io_thread(monkeypatch: pytest.MonkeyPatch, old_checkpoint: tuple[Path, bytes],
                                  after: int, direct_io: bool | None) -> None:
    path, _ = old_checkpoint
    state, fds = big_state(), fd_count()
    with fail_in_io_thread(monkeypatch, "pwrite_all", after, eio), reaches_caller(OSError):
        ckptstream.save(state, path, settings=small(direct_io))
    assert_released()
    assert fd_count() == fds


@pytest.mark.parametrize("after", [0, 3])
def test_device_to_file_error_in_io_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, after: int) -> None:
    t, fds = big_state()["v"], fd_count()
    with fail_in_io_thread(monkeypatch, "pwrite_all", after, eio), reaches_caller(OSError):
        ckptstream.device_to_file(t, tmp_path / "raw.bin", settings=SMALL)
    with open(tmp_path / "raw2.bin", "wb") as f, fail_in_io_thread(monkeypatch, "pwrite_all", after, eio), \
            reaches_caller(OSError):  # fmt: skip
        ckptstream.device_to_file(t, f, settings=SMALL)
    assert_released()
    assert fd_count() == fds


READERS: dict[str, Callable[[Path, Any], Any]] = {
    "load": lambda path, state: ckptstream.load(path, mmap=False, settings=SMALL),  # mapped: no I/O thread
    "verify": lambda path, state: ckptstream.verify(path),
    "load_into": lambda path, state: ckptstream.load_into(state, path, settings=SMALL),
    "file_to_device": lambda path, state: ckptstream.file_to_device(path, torch.empty(MiB // 4), offset=0,
                                                                    settings=SMALL),
}


@pytest.mark.parametrize("after", [0, 5])
@pytest.mark.parametrize("reader", list(READERS))
def test_read_error_in_io_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, reader: str, after: int) -> None:
    path, state = tmp_path / "ckpt.safetensors", big_state()
    ckptstream.save(state, path)
    READERS[reader](path, state)  # warm up
    fds = fd_count()
    with ckptstream.settings(buffer_size=64 * KiB), fail_in_io_thread(monkeypatch, READ_CALLS, after, eio), \
            reaches_caller(OSError):  # fmt: skip
        READERS[reader](path, state)
    assert_released()
    assert fd_count() == fds
    assert_same_state(ckptstream.load(path), state)  # the file itself is fine


# --- KeyboardInterrupt -------------------------------------------------------------------------


def raise_after(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, after: int,
                exc: Callable[[], BaseException]) -> None:
    """Make ``owner.<name>`` raise ``exc()`` once its (after+1)-th call (counted over all
    threads) has done its work (for a chunk's copies: once they are enqueued)."""
    original, calls, lock = getattr(owner, name), [0], threading.Lock()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[0] += 1
            n = calls[0]
        result = original(*args, **kwargs)
        if n == after + 1:
            raise exc()
        return result

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.parametrize("after", [0, 3, 20])
def test_keyboard_interrupt_during_save_copies(monkeypatch: pytest.MonkeyPatch, old_checkpoint: tuple[Path, bytes],
                                               after: int) -> None:
    """Ctrl-C (a KeyboardInterrupt) where an I/O thread has just enqueued a chunk's device
    copies (32 chunks in all): it reaches the caller, as it is."""
    path, _ = old_checkpoint
    state, fds = big_state(), fd_count()
    raise_after(monkeypatch, WriteEngine, "_move", after, KeyboardInterrupt)
    with reaches_caller(KeyboardInterrupt):
        ckptstream.save(state, path, settings=SMALL)
    assert_released()
    assert fd_count() == fds


@pytest.mark.parametrize("after", [0, 3, 10])
def test_keyboard_interrupt_during_load_copies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, after: int) -> None:
    """An exception raised in an I/O thread by a copy into a non-contiguous target (``v``, 16
    chunks of it, copied in chunk order across the threads) reaches the caller, as it is."""
    path, state = tmp_path / "ckpt.safetensors", big_state()
    ckptstream.save(state, path)
    ckptstream.load_into(state, path)
    fds = fd_count()
    raise_after(monkeypatch, read_engine, "copy_in", after, KeyboardInterrupt)
    with reaches_caller(KeyboardInterrupt):
        ckptstream.load_into(state, path, settings=SMALL)
    assert_released()
    assert fd_count() == fds


def sigint_main_thread() -> None:
    """What Ctrl-C does: SIGINT to the main thread, interrupting whatever it waits on."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


@pytest.mark.parametrize("deliver", [sigint_main_thread, _thread.interrupt_main], ids=["sigint", "interrupt_main"])
@pytest.mark.parametrize("after", [1, 6])
def test_asynchronous_keyboard_interrupt_while_waiting(monkeypatch: pytest.MonkeyPatch,
                                                       old_checkpoint: tuple[Path, bytes], after: int,
                                                       deliver: Callable[[], None]) -> None:
    """KeyboardInterrupt delivered to the main thread while it waits for free buffers or for
    reads (an I/O thread triggers it after ``after`` chunks, long before the transfer ends)."""
    needs_ctrl_c()
    path, _ = old_checkpoint
    state, fds = big_state(), fd_count()
    with fail_in_io_thread(monkeypatch, "pwrite_all", after, deliver), reaches_caller(KeyboardInterrupt):
        ckptstream.save(state, path, settings=SMALL)
    assert_released()
    assert fd_count() == fds
    other = path.parent / "other.safetensors"
    ckptstream.save(state, other)
    with fail_in_io_thread(monkeypatch, READ_CALLS, after, deliver), reaches_caller(KeyboardInterrupt):
        ckptstream.load(other, mmap=False, settings=SMALL)
    other.unlink()
    assert_released()
    assert fd_count() == fds


@contextlib.contextmanager
def interrupted_thread_start(engine_type: type[Engine]) -> Iterator[None]:
    """A KeyboardInterrupt right after the second I/O thread of an ``engine_type`` started: the
    engine is interrupted while it starts its threads, one of them already at work."""
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        original(self)
        target = getattr(self, "_target", None)
        if isinstance(getattr(target, "__self__", None), engine_type) and self.name.endswith("-1"):
            raise KeyboardInterrupt

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]


@pytest.mark.parametrize("op", ["save", "load"])
def test_interrupt_while_starting_the_io_threads(monkeypatch: pytest.MonkeyPatch,
                                                 old_checkpoint: tuple[Path, bytes], op: str) -> None:
    """The threads already started must not outlive the call: they would otherwise go on
    filling a staging buffer already back in the pool, or write to a closed descriptor."""
    path, _ = old_checkpoint
    state = big_state()
    other = path.parent / "other.safetensors"
    ckptstream.save(state, other)
    engine_type, names = (WriteEngine, ("pwrite_all",)) if op == "save" else (ReadEngine, READ_CALLS)
    calls = [0]

    def slow(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.05)  # the threads are at work when the caller gets the interrupt
            calls[0] += 1
            return original(*args, **kwargs)
        return call

    for name in names:
        monkeypatch.setattr(fileio, name, slow(getattr(fileio, name)))
    with interrupted_thread_start(engine_type), reaches_caller(KeyboardInterrupt):
        if op == "save":
            ckptstream.save(state, path, settings=SMALL)
        else:
            ckptstream.load(other, mmap=False, settings=SMALL)
    assert_released()
    done = calls[0]
    time.sleep(0.2)
    assert calls[0] == done, "an I/O thread went on after the call returned"
    other.unlink()


# --- no leaks after many failures ---------------------------------------------------------------


def native_threads() -> int:
    """This process's OS threads, once joined threads have also left the kernel's list (a thread
    is joined when its Python side ends, a moment before the OS thread is gone)."""
    count, deadline = len(os.listdir("/proc/self/task")), time.monotonic() + 2
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = len(os.listdir("/proc/self/task"))
        if now == count:
            break
        count = now
    return count


def test_one_hundred_failing_transfers_leak_nothing(monkeypatch: pytest.MonkeyPatch,
                                                    old_checkpoint: tuple[Path, bytes]) -> None:
    path, _ = old_checkpoint
    state = big_state(mib=4)
    other = path.parent / "other.safetensors"
    ckptstream.save(state, other)
    settings: dict[str, Any] = {"buffer_size": 256 * KiB, "num_buffers": 4}

    def failing_transfer(i: int) -> None:
        kind = i % 5
        with monkeypatch.context() as m:
            if kind == 0:
                with fail_in_io_thread(m, "pwrite_all", i % 7, eio), pytest.raises(OSError, match="injected I/O"):
                    ckptstream.save(state, path, settings=Settings(**settings))
            elif kind == 1:
                with fail_in_io_thread(m, "pwrite_all", i % 3, enospc), pytest.raises(OSError, match="no space"):
                    ckptstream.save(state, path, settings=Settings(**settings))
            elif kind == 2:
                raise_after(m, WriteEngine, "_move", i % 9, KeyboardInterrupt)
                with pytest.raises(KeyboardInterrupt):
                    ckptstream.save(state, path, settings=Settings(**settings))
            elif kind == 3:
                raise_after(m, WriteEngine, "_move", i % 4, lambda: RuntimeError("injected copy failure"))
                with pytest.raises(RuntimeError, match="injected copy failure"):
                    ckptstream.save(state, path, settings=Settings(**settings))
            else:
                with fail_in_io_thread(m, READ_CALLS, i % 6, eio), pytest.raises(OSError, match="injected I/O"):
                    ckptstream.load(other, mmap=False, settings=Settings(**settings))

    for i in range(20):  # warm up: the pool's buffers, allocator arenas, lazily opened files
        failing_transfer(i)
    fds, threads, native, rss = fd_count(), threading.active_count(), native_threads(), settled_rss_kib()
    for i in range(100):
        failing_transfer(i)
        assert_released()
    assert fd_count() <= fds  # fewer where an earlier test's sockets were collected meanwhile
    assert (threading.active_count(), native_threads()) == (threads, native)
    # a leak of anything per failure shows: a set of staging buffers is 1 MiB, a loaded state 4 MiB
    grown = settled_rss_kib() - rss
    assert grown < 8 * 1024, f"RSS grew by {grown} KiB over 100 failing transfers"
    assert all_temp_files(path.parent) == []
    os.unlink(other)


# --- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("after", [0, 5])
@pytest.mark.parametrize("direction", ["save", "load"])
def test_failing_device_copy_on_gpu(monkeypatch: pytest.MonkeyPatch, old_checkpoint: tuple[Path, bytes],
                                    direction: str, after: int) -> None:
    path, _ = old_checkpoint
    state = big_state("cuda")
    source = path.parent / "source.safetensors"
    ckptstream.save(state, source)
    ckptstream.load(source, device="cuda")  # warm up: CUDA context, pinned buffers
    fds = fd_count()
    fail = lambda: RuntimeError("injected device copy failure")  # noqa: E731
    raise_after(monkeypatch, WriteEngine if direction == "save" else ReadEngine,
                "_move" if direction == "save" else "_copy_parts", after, fail)
    with reaches_caller(RuntimeError):
        if direction == "save":
            ckptstream.save(state, path, settings=SMALL)
        else:
            ckptstream.load_into(state, source, settings=SMALL)
    torch.cuda.synchronize()
    assert_released()
    assert fd_count() == fds
    monkeypatch.undo()
    assert_same_state(ckptstream.load(source, device="cuda"), ckptstream.load(source))
    os.unlink(source)


@pytest.mark.gpu
@pytest.mark.parametrize("after", [0, 5])
def test_io_error_with_gpu_tensors(monkeypatch: pytest.MonkeyPatch, old_checkpoint: tuple[Path, bytes],
                                   after: int) -> None:
    path, _ = old_checkpoint
    state = big_state("cuda")
    ckptstream.save(state, path.parent / "warm.safetensors")
    ckptstream.load(path.parent / "warm.safetensors", device="cuda")
    fds = fd_count()
    with fail_in_io_thread(monkeypatch, "pwrite_all", after, eio), reaches_caller(OSError):
        ckptstream.save(state, path, settings=SMALL)
    with fail_in_io_thread(monkeypatch, READ_CALLS, after, eio), reaches_caller(OSError):
        ckptstream.load(path.parent / "warm.safetensors", device="cuda", settings=SMALL)
    torch.cuda.synchronize()
    assert_released()
    assert fd_count() == fds
    os.unlink(path.parent / "warm.safetensors")
