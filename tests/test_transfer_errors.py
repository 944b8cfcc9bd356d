"""device_to_file / file_to_device error paths: bad arguments, OS errors, failures in an I/O
thread or in the device copies. Every one must join its threads, return its buffers and close
its files; the staging pool is reused across transfers."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine import ReadEngine, WriteEngine
from ckptstream._engine.buffers import POOL
from ckptstream._storage import fileio
from tests.helpers import (
    POISON_BYTE,
    READ_CALLS,
    Resources,
    as_bytes,
    assert_bytes_equal,
    fail_kth_call,
    fail_on_call,
    poisoned_like,
    random_bytes,
    random_tensor,
    spy_on_staging,
)

# --- argument errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["buffer_size", "num_buffers"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_bad_buffer_arguments(tmp_path: Path, name: str, value: Any) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"keep me")
    t = random_bytes(10)
    with pytest.raises(ValueError, match=name):
        ckptstream.device_to_file(t, path, settings=ckptstream.Settings(**{name: value}))
    with pytest.raises(ValueError, match=name):
        ckptstream.file_to_device(path, t, settings=ckptstream.Settings(**{name: value}))
    with pytest.raises(ValueError, match=name), ckptstream.settings(**{name: value}):
        ckptstream.device_to_file(t, path)
    assert path.read_bytes() == b"keep me"


def test_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"0123456789" * 100)
    t = random_tensor(10)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        ckptstream.device_to_file([1.0, 2.0], path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="file must be"):
        ckptstream.device_to_file(t, 3.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offset"):
        ckptstream.device_to_file(t, path, offset=-1)
    with pytest.raises(ckptstream.UnsupportedTypeError):
        ckptstream.device_to_file(t.to_sparse(), path)
    with pytest.raises(ckptstream.UnsupportedTypeError):
        ckptstream.file_to_device(path, torch.empty(10, device="meta"))
    with pytest.raises(TypeError, match="stream"):
        ckptstream.device_to_file(t, path, stream="cuda:0")  # type: ignore[arg-type]
    assert path.read_bytes() == b"0123456789" * 100


def test_expanded_destination_is_refused(tmp_path: Path) -> None:
    """An expanded view's elements share memory: reading distinct bytes into it cannot work."""
    path = tmp_path / "t.bin"
    path.write_bytes(as_bytes(random_bytes(4 * 5 * 4)))
    dst = poisoned_like(torch.empty(5)).expand(4, 5)
    with open(path, "rb") as f, pytest.raises(ValueError, match="expanded"):
        ckptstream.file_to_device(f, dst, settings=Settings(buffer_size=7))
    assert as_bytes(dst) == bytes([POISON_BYTE]) * 80


# --- OS errors ----------------------------------------------------------------------------------


def test_os_errors_keep_errno_and_name_the_file(device: torch.device, tmp_path: Path) -> None:
    t = random_tensor(1000, torch.float32, device)
    missing = tmp_path / "no" / "such" / "dir.bin"
    with pytest.raises(FileNotFoundError) as info:
        ckptstream.device_to_file(t, missing)
    assert info.value.errno == errno.ENOENT
    assert str(missing) in str(info.value)

    before = Resources.snapshot()
    for dst in (t, t.view(40, 25).t()):  # read straight into the tensor, and through staging buffers
        with pytest.raises(IsADirectoryError) as info2:  # open succeeds; the read fails in an I/O thread
            ckptstream.file_to_device(tmp_path, dst, settings=Settings(buffer_size=1000))
        assert info2.value.errno == errno.EISDIR
        assert str(tmp_path) in str(info2.value)
        before.assert_released()

    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Bad file descriptor") as info3:
            ckptstream.device_to_file(t, fd, settings=Settings(buffer_size=1000))
        assert info3.value.errno == errno.EBADF
        assert str(path) in str(info3.value)
    finally:
        os.close(fd)
    before.assert_released()


# --- failures in the middle of a transfer ------------------------------------------------------


def _transfer(direction: str, src: torch.Tensor, path: Path, **kw: Any) -> None:
    """Write ``src`` to ``path``, or read the file into a poisoned tensor like ``src``:
    ``read`` into a contiguous one, ``read_staged`` into its transpose (through the staging
    buffers)."""
    if direction == "write":
        ckptstream.device_to_file(src, path, settings=Settings(**kw))
    elif direction == "read":
        ckptstream.file_to_device(path, poisoned_like(src), settings=Settings(**kw))
    else:
        ckptstream.file_to_device(path, poisoned_like(src.reshape(-1)).view(64, -1).t(), settings=Settings(**kw))


def _eio(path: str) -> OSError:
    return OSError(errno.EIO, "injected I/O error", path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [_eio, KeyboardInterrupt], ids=["EIO", "KeyboardInterrupt"])
@pytest.mark.parametrize("io_threads", [1, 3])
@pytest.mark.parametrize("k", [1, 5, 32])  # the first, a middle and the last chunk
@pytest.mark.parametrize("direction", ["write", "read", "read_staged"])
def test_failure_in_an_io_thread(device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 direction: str, k: int, io_threads: int, exc: Callable[[str], BaseException]) -> None:
    """The k-th pwrite/pread fails: the caller gets that exception, nothing hangs, and threads,
    buffers and descriptors are all released. (``read`` fills the destination straight from the
    file where it is a host tensor; ``read_staged`` goes through the staging buffers.)"""
    src = random_bytes(32 * 256, device)  # 32 chunks of 256 bytes
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(src, path, settings=Settings(buffer_size=256, num_buffers=3))  # warm up the device
    before = Resources.snapshot()
    names = ("pwrite_all",) if direction == "write" else READ_CALLS
    calls = fail_on_call(k, lambda *args: None, exc)  # one count over every primitive patched
    for name in names:
        real = getattr(fileio, name)

        def failing(*args: Any, real: Callable[..., Any] = real) -> Any:
            calls(*args)
            return real(*args)

        monkeypatch.setattr(fileio, name, failing)
    expected = OSError if exc is _eio else KeyboardInterrupt
    start = time.monotonic()
    with ckptstream.settings(io_threads=io_threads), pytest.raises(expected) as info:
        _transfer(direction, src, path, buffer_size=256, num_buffers=3)
    assert time.monotonic() - start < 10
    if isinstance(info.value, OSError):
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(path)
    before.assert_released()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("direction", ["write", "read"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_failure_in_the_device_copies(device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      layout: str, direction: str, k: int, exc: type[BaseException]) -> None:
    """Moving a chunk's bytes between the tensor and its staging buffer fails (or Ctrl-C arrives
    there) once its copies are enqueued, while other I/O threads are busy: same cleanup, no
    hang. A read into a contiguous host tensor has no copies: its read into the tensor fails."""
    base = random_tensor((64, 128), torch.float32, device)
    src = base if layout == "contiguous" else base.t()
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(src, path, settings=Settings(buffer_size=1024))  # warm up; the read below needs the file
    before = Resources.snapshot()
    if direction == "write":
        fail_kth_call(monkeypatch, WriteEngine, ("_move",), k, lambda: exc("injected"), after=True)
    else:
        fail_kth_call(monkeypatch, ReadEngine, ("_copy_parts", "_read_into_host"), k, lambda: exc("injected"),
                      after=True)
    with ckptstream.settings(io_threads=3, num_buffers=3), pytest.raises(exc, match="injected"):
        _transfer(direction if direction == "write" or layout == "contiguous" else "read_staged", src, path,
                  buffer_size=1024)
    before.assert_released()


# --- the buffer pool ---------------------------------------------------------------------------


def test_pool_reuses_buffers(device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_bytes(50000, device)
    path = tmp_path / "t.bin"
    kw: dict[str, Any] = {"buffer_size": 3001, "num_buffers": 3}  # a size no other test uses

    def round_trip() -> None:
        ckptstream.device_to_file(src, path, settings=Settings(**kw))
        dst = poisoned_like(src)
        ckptstream.file_to_device(path, dst, settings=Settings(**kw))
        assert_bytes_equal(dst, src)
        staged = poisoned_like(src).view(500, 100).t()  # a read through the staging buffers
        ckptstream.file_to_device(path, staged, settings=Settings(**kw))
        assert_bytes_equal(staged, src.view(100, 500))

    round_trip()
    idle = POOL.idle_bytes()
    for _ in range(5):
        round_trip()
    assert POOL.idle_bytes() == idle
    assert POOL.in_use == 0

    monkeypatch.setattr(fileio, "pwrite_all", fail_on_call(2, fileio.pwrite_all, _eio))
    with pytest.raises(OSError, match="injected"):
        ckptstream.device_to_file(src, path, settings=Settings(**kw))
    assert POOL.idle_bytes() == idle
    assert POOL.in_use == 0


def test_pool_takes_no_more_buffers_than_chunks(tmp_path: Path) -> None:
    ckptstream.device_to_file(random_bytes(5000), tmp_path / "t.bin", settings=Settings(buffer_size=3011,
                                                                                        num_buffers=8))
    assert POOL.idle_bytes() == 2 * 3011  # two chunks; the pool keeps this kind of buffer only


def test_reads_into_host_tensors_take_no_staging_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A contiguous host destination is read straight into (no staging buffer, no second copy);
    only the non-contiguous one of two takes buffers."""
    src = random_bytes(40000)
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(src, path)
    taken = spy_on_staging(monkeypatch)
    dst = poisoned_like(src)
    ckptstream.file_to_device(path, dst, settings=Settings(buffer_size=3019, num_buffers=2))
    assert taken == []
    assert_bytes_equal(dst, src)
    staged = poisoned_like(src).view(200, 200).t()
    ckptstream.file_to_device(path, staged, settings=Settings(buffer_size=3019, num_buffers=2))
    assert taken == [(3019, 2)]
    assert_bytes_equal(staged, src.view(200, 200))
