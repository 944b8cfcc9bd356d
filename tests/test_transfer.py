"""device_to_file / file_to_device: round trips, file positions and offsets, O_DIRECT, settings,
and the error paths (every one must join its threads, return its buffers and close its files)."""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import _fileio, _pipeline, _settings
from ckptstream._buffers import POOL
from conftest import (
    EDGE_CASE_NAMES,
    EDGE_CASES,
    POISON_BYTE,
    Resources,
    as_bytes,
    assert_bytes_equal,
    poisoned_like,
    random_bytes,
    random_tensor,
)

KiB, MiB = 1 << 10, 1 << 20


def direct_io_supported(directory: Path) -> bool:
    """Whether the file system under ``directory`` accepts an aligned O_DIRECT write (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / ".o_direct_probe"
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, 4096) as block:
            os.pwrite(fd, block, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


@pytest.fixture(params=[False, True, None], ids=["buffered", "direct", "auto"])
def direct_io(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[bool | None]:
    """Runs the test under ``ckptstream.settings(direct_io=...)`` for each mode."""
    if request.param is True and not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    with ckptstream.settings(direct_io=request.param):
        yield request.param


@pytest.fixture
def jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short random sleeps before every pwrite/pread, so that I/O threads finish out of order."""
    rng = random.Random(1234)

    def delayed(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            time.sleep(rng.random() * 3e-4)
            return real(*args)
        return call

    monkeypatch.setattr(_fileio, "pwrite_all", delayed(_fileio.pwrite_all))
    monkeypatch.setattr(_fileio, "pread_into", delayed(_fileio.pread_into))


def fail_on_call(k: int, real: Callable[..., Any], exc: Callable[[str], BaseException]) -> Callable[..., Any]:
    """``real``, except that its k-th call (counted over all threads) raises ``exc(path)``."""
    calls = itertools.count(1)

    def call(*args: Any) -> Any:
        if next(calls) == k:
            raise exc(args[-1])  # pwrite_all / pread_into take the path last
        return real(*args)
    return call


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- round trips ------------------------------------------------------------------------------

SEED_MATRIX = [(1025, 10000, 10000), (1025, 1024, 513), (500, 2000, 2000), (125000, 10000, 10000)]


@pytest.mark.parametrize("num_buffers", [1, 2])
@pytest.mark.parametrize(("n", "write_size", "read_size"), SEED_MATRIX)
def test_seed_matrix(device: torch.device, tmp_path: Path, n: int, write_size: int, read_size: int,
                     num_buffers: int) -> None:
    src = random_tensor(n, torch.float32, device)
    path = tmp_path / "t.bin"
    assert ckptstream.device_to_file(src, path, buffer_size=write_size, num_buffers=num_buffers) == 4 * n
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, buffer_size=read_size, num_buffers=num_buffers) == 4 * n
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize(("write_size", "read_size"), [(13, 7), (4096, 4099), (None, None)],
                         ids=["tiny", "page", "default"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=EDGE_CASE_NAMES)
def test_edge_case_round_trip(device: torch.device, tmp_path: Path, case: Any, write_size: int | None,
                              read_size: int | None) -> None:
    """Every dtype and layout: the file holds the logical row-major bytes (src.contiguous()),
    and a read fills the same kind of view without touching the storage around it."""
    src = case.source(device)
    path = tmp_path / "t.bin"
    assert ckptstream.device_to_file(src, path, buffer_size=write_size) == nbytes(src)
    assert path.read_bytes() == as_bytes(src)
    if case.writable:
        base, dst = case.destination(device)
    else:  # an expanded view cannot be a destination: read its bytes into a plain tensor
        base = dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, buffer_size=read_size) == nbytes(src)
    assert_bytes_equal(dst, src)
    if case.writable:
        assert_bytes_equal(base, case.expected_base(src))


def test_zero_bytes(device: torch.device, tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"old contents")
    empty = torch.empty(0, 5, device=device)
    assert ckptstream.device_to_file(empty, path) == 0
    assert path.read_bytes() == b""  # a path with offset=None is truncated
    assert ckptstream.file_to_device(path, torch.empty(0, device=device)) == 0
    with open(path, "r+b") as f:
        f.write(b"abc")
        assert ckptstream.device_to_file(empty, f) == 0
        assert f.tell() == 3
        assert ckptstream.file_to_device(f, empty, offset=3) == 0
    assert path.read_bytes() == b"abc"


def test_one_byte(device: torch.device, tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    src = random_bytes(1, device)
    assert ckptstream.device_to_file(src, path, buffer_size=1, num_buffers=1) == 1
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, buffer_size=1) == 1
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize("size", [3, 4095, 4097, 12289, 65537])
@pytest.mark.parametrize("buffer_size", [4096, 8192, 1000, 4097])
def test_odd_sizes(device: torch.device, tmp_path: Path, direct_io: bool | None, size: int, buffer_size: int) -> None:
    src = random_bytes(size, device)
    path = tmp_path / "t.bin"
    if direct_io and buffer_size % 4096:
        with pytest.raises(ValueError, match="multiple of 4096"):
            ckptstream.device_to_file(src, path, buffer_size=buffer_size)
        return
    assert ckptstream.device_to_file(src, path, buffer_size=buffer_size, num_buffers=3) == size
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, buffer_size=buffer_size, num_buffers=2) == size
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize("buffer_size", [1, 3, 1000, 4095, 4097, 10000, 12289])
def test_buffer_sizes_not_multiples_of_4096(device: torch.device, tmp_path: Path, buffer_size: int) -> None:
    src = random_tensor(1001 if buffer_size < 1000 else 30001, torch.float16, device)  # odd element counts
    path = tmp_path / "t.bin"
    assert ckptstream.device_to_file(src, path, buffer_size=buffer_size) == nbytes(src)
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    ckptstream.file_to_device(path, dst, buffer_size=buffer_size + 2)
    assert_bytes_equal(dst, src)


def test_parameter_round_trip(device: torch.device, tmp_path: Path) -> None:
    """Leaves that require grad are read and written in place, without autograd errors."""
    p = torch.nn.Parameter(random_tensor((17, 3), torch.float32, device))
    path = tmp_path / "p.bin"
    ckptstream.device_to_file(p, path, buffer_size=20)
    q = torch.nn.Parameter(poisoned_like(p.detach()))
    ckptstream.file_to_device(path, q, buffer_size=28)
    assert_bytes_equal(q.detach(), p.detach())
    assert q.requires_grad and q.grad_fn is None


# --- the reuse race: many chunks through few buffers ---------------------------------------------


@pytest.mark.parametrize(("buffer_size", "num_buffers", "io_threads"), [(4096, 2, 2), (8192, 3, 3), (4096, 3, 2)])
def test_many_chunks_through_few_buffers(device: torch.device, tmp_path: Path, buffer_size: int,
                                         num_buffers: int, io_threads: int) -> None:
    """4 MiB through 2-3 small buffers and several I/O threads: a buffer refilled before its
    write (or its host-to-device copy) finished would show as corrupt bytes."""
    src = random_tensor(MiB, torch.float32, device)
    path = tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=buffer_size, num_buffers=num_buffers, io_threads=io_threads,
                             direct_io=False):
        for _ in range(2):
            assert ckptstream.device_to_file(src, path) == 4 * MiB
            assert path.read_bytes() == as_bytes(src)
            dst = poisoned_like(src)
            assert ckptstream.file_to_device(path, dst) == 4 * MiB
            assert_bytes_equal(dst, src)


@pytest.mark.usefixtures("jitter")
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_out_of_order_io_threads(device: torch.device, tmp_path: Path, direct_io: bool | None, layout: str) -> None:
    """I/O threads finishing in random order must not reorder or mix chunks."""
    base = random_tensor((256, 257), torch.float32, device)
    src = base if layout == "contiguous" else base.t()
    path = tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=4096, num_buffers=3, io_threads=3):
        ckptstream.device_to_file(src, path, offset=4099 if direct_io else None)
        data = path.read_bytes()
        assert data[-nbytes(src):] == as_bytes(src)
        dst = poisoned_like(base).t() if layout == "transposed" else poisoned_like(base)
        ckptstream.file_to_device(path, dst, offset=len(data) - nbytes(src))
    assert_bytes_equal(dst, src)


# --- one file object: header, tensors, tail ---------------------------------------------------


class _File:
    """A file opened as a buffered object, an unbuffered object or a raw fd, with one interface."""

    def __init__(self, kind: str, path: Path, mode: str) -> None:
        self.kind = kind
        if kind == "fd":
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if mode == "w" else os.O_RDONLY
            self.file: Any = os.open(path, flags, 0o644)
        else:
            self.file = open(path, mode + "b", buffering=0 if kind == "unbuffered" else -1)  # noqa: SIM115

    def write(self, data: bytes) -> None:
        if self.kind == "fd":
            assert os.write(self.file, data) == len(data)
        else:
            self.file.write(data)

    def read(self, n: int = -1) -> bytes:
        if self.kind != "fd":
            return bytes(self.file.read(n))
        out = b""
        while n < 0 or len(out) < n:
            more = os.read(self.file, (n - len(out)) if n >= 0 else 1 << 16)
            if not more:
                break
            out += more
        return out

    def tell(self) -> int:
        return os.lseek(self.file, 0, os.SEEK_CUR) if self.kind == "fd" else int(self.file.tell())

    def close(self) -> None:
        if self.kind == "fd":
            os.close(self.file)
        else:
            self.file.close()


@pytest.mark.parametrize("kind", ["buffered", "unbuffered", "fd"])
def test_header_tensors_tail_through_one_file(device: torch.device, tmp_path: Path, kind: str) -> None:
    header, tail = b"HEADER-" * 3 + b"!", b"--tail--"  # 22 bytes: the tensors land at odd offsets
    t1 = random_tensor(1001, torch.float32, device)
    t2 = random_tensor((33, 7), torch.bfloat16, device).t()
    path = tmp_path / "state.bin"
    f = _File(kind, path, "w")
    try:
        f.write(header)  # still in the object's buffer when device_to_file starts (buffered)
        assert ckptstream.device_to_file(t1, f.file, buffer_size=1000) == 4004
        assert f.tell() == 22 + 4004
        assert ckptstream.device_to_file(t2, f.file, buffer_size=1000, num_buffers=1) == 462
        assert f.tell() == 22 + 4004 + 462
        f.write(tail)
    finally:
        f.close()
    assert path.read_bytes() == header + as_bytes(t1) + as_bytes(t2) + tail

    f = _File(kind, path, "r")
    try:
        assert f.read(len(header)) == header  # a buffered reader has read ahead past the header
        d1, d2 = poisoned_like(t1), poisoned_like(t2.t()).t()
        assert ckptstream.file_to_device(f.file, d1, buffer_size=777) == 4004
        assert f.tell() == 22 + 4004
        assert ckptstream.file_to_device(f.file, d2, buffer_size=100) == 462
        assert f.tell() == 22 + 4004 + 462
        assert f.read() == tail
    finally:
        f.close()
    assert_bytes_equal(d1, t1)
    assert_bytes_equal(d2, t2)


def test_read_write_object_round_trip(device: torch.device, tmp_path: Path) -> None:
    """One "w+b" object: write everything, seek back, read everything."""
    t1, t2 = random_tensor(300, torch.int16, device), random_tensor(77, torch.float64, device)
    with open(tmp_path / "s.bin", "w+b") as f:
        f.write(b"abc")
        ckptstream.device_to_file(t1, f, buffer_size=64)
        ckptstream.device_to_file(t2, f, buffer_size=64)
        f.write(b"xyz")
        f.seek(0)
        assert f.read(3) == b"abc"
        d1, d2 = poisoned_like(t1), poisoned_like(t2)
        ckptstream.file_to_device(f, d1, buffer_size=50)
        ckptstream.file_to_device(f, d2, buffer_size=50)
        assert f.read() == b"xyz"
    assert_bytes_equal(d1, t1)
    assert_bytes_equal(d2, t2)


def test_read_sees_the_objects_own_pending_writes(device: torch.device, tmp_path: Path) -> None:
    src = random_tensor(100, torch.float32, device)
    with open(tmp_path / "s.bin", "w+b") as f:
        f.write(b"abc" + as_bytes(src))  # small: still in the object's write buffer
        dst = poisoned_like(src)
        assert ckptstream.file_to_device(f, dst, offset=3) == 400
        assert f.tell() == 403  # an explicit offset leaves the position alone
    assert_bytes_equal(dst, src)


@pytest.mark.usefixtures("jitter")
@pytest.mark.parametrize("kind", ["object", "fd"])
def test_append_mode_file(device: torch.device, tmp_path: Path, kind: str) -> None:
    """O_APPEND makes Linux pwrite ignore its offset: chunks must still land in order, offset=None
    appends, and an explicit offset is honoured."""
    path = tmp_path / "a.bin"
    path.write_bytes(b"HEAD")
    src = random_bytes(64 * KiB, device)
    patch = random_bytes(10, device)
    f: Any = open(path, "ab") if kind == "object" else os.open(path, os.O_WRONLY | os.O_APPEND)  # noqa: SIM115
    try:
        with ckptstream.settings(io_threads=4, num_buffers=4):
            assert ckptstream.device_to_file(src, f, buffer_size=1024) == 64 * KiB
        assert (f.tell() if kind == "object" else os.lseek(f, 0, os.SEEK_CUR)) == 4 + 64 * KiB
        ckptstream.device_to_file(patch, f, offset=1)
        if kind == "object":
            f.write(b"TAIL")
        else:
            os.write(f, b"TAIL")
    finally:
        f.close() if kind == "object" else os.close(f)
    whole = b"HEAD" + as_bytes(src)
    assert path.read_bytes() == whole[:1] + as_bytes(patch) + whole[11:] + b"TAIL"


# --- explicit offsets -------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 4096, 5003])
@pytest.mark.parametrize("buffer_size", [4096, 12288, 10000])
@pytest.mark.parametrize("target", ["path", "fd", "object"])
def test_explicit_offset_in_an_existing_file(device: torch.device, tmp_path: Path, direct_io: bool | None,
                                             target: str, buffer_size: int, offset: int) -> None:
    """Positional I/O: only [offset, offset + n) changes, the file position stays where it was."""
    path = tmp_path / "t.bin"
    existing = as_bytes(random_bytes(30011))
    path.write_bytes(existing)
    src = random_tensor(2500, torch.float32, device)  # 10000 bytes: ends inside a page
    dst = poisoned_like(src)
    kw: dict[str, Any] = {"offset": offset, "buffer_size": buffer_size}
    if direct_io and buffer_size % 4096:
        with pytest.raises(ValueError, match="multiple of 4096"):
            ckptstream.device_to_file(src, path, **kw)
        assert path.read_bytes() == existing
        return
    if target == "path":
        assert ckptstream.device_to_file(src, path, **kw) == 10000
        assert ckptstream.file_to_device(path, dst, **kw) == 10000
    elif target == "fd":
        fd = os.open(path, os.O_RDWR)
        try:
            os.lseek(fd, 123, os.SEEK_SET)
            assert ckptstream.device_to_file(src, fd, **kw) == 10000
            assert os.lseek(fd, 0, os.SEEK_CUR) == 123
            assert ckptstream.file_to_device(fd, dst, **kw) == 10000
            assert os.lseek(fd, 0, os.SEEK_CUR) == 123
        finally:
            os.close(fd)
    else:
        with open(path, "r+b") as f:
            f.seek(123)
            assert ckptstream.device_to_file(src, f, **kw) == 10000
            assert f.tell() == 123
            assert ckptstream.file_to_device(f, dst, **kw) == 10000
            assert f.tell() == 123
    assert path.read_bytes() == existing[:offset] + as_bytes(src) + existing[offset + 10000:]
    assert_bytes_equal(dst, src)


def test_offset_past_the_end_extends_the_file(device: torch.device, tmp_path: Path, direct_io: bool | None) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 100)
    src = random_bytes(5000, device)
    assert ckptstream.device_to_file(src, path, offset=8195, buffer_size=4096) == 5000
    assert path.read_bytes() == b"x" * 100 + bytes(8095) + as_bytes(src)


# --- O_DIRECT ---------------------------------------------------------------------------------


def test_direct_io_setting_decides_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    opened: list[bool] = []
    real = _fileio.open_direct

    def spy(fd: int, path: str, force: bool) -> int | None:
        direct_fd = real(fd, path, force)
        assert direct_fd is not None
        opened.append(bool(fcntl.fcntl(direct_fd, fcntl.F_GETFL) & os.O_DIRECT))
        return direct_fd

    monkeypatch.setattr(_fileio, "open_direct", spy)
    src = random_bytes(20000)
    path = tmp_path / "t.bin"

    def round_trip(buffer_size: int) -> list[bool]:
        opened.clear()
        ckptstream.device_to_file(src, path, buffer_size=buffer_size)
        dst = poisoned_like(src)
        ckptstream.file_to_device(path, dst, buffer_size=buffer_size)
        assert_bytes_equal(dst, src)
        return list(opened)

    with ckptstream.settings(direct_io=False):
        assert round_trip(8192) == []
    with ckptstream.settings(direct_io=True):
        assert round_trip(8192) == [True, True]
    with ckptstream.settings(direct_io=None):
        assert round_trip(8192) == [True]  # writes only: reads keep the page cache
        assert round_trip(10000) == []  # unaligned buffers cannot go direct


def test_direct_io_needs_aligned_buffers(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"keep me")
    src = random_bytes(100)
    with ckptstream.settings(direct_io=True):
        with pytest.raises(ValueError, match="multiple of 4096"):
            ckptstream.device_to_file(src, path, buffer_size=10000)
        with pytest.raises(ValueError, match="multiple of 4096"):
            ckptstream.file_to_device(path, src, buffer_size=4097)
    with pytest.raises(ValueError, match="multiple of 4096"), ckptstream.settings(direct_io=True, buffer_size=5000):
        pass
    assert path.read_bytes() == b"keep me"  # rejected before the file was opened (and truncated)


def test_direct_io_keeps_a_read_only_descriptor_read_only(tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        with ckptstream.settings(direct_io=True), pytest.raises(OSError) as info:
            ckptstream.device_to_file(random_bytes(4096), fd, offset=0, buffer_size=4096)  # one aligned block
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(8192)


# --- return values and argument errors ----------------------------------------------------------


@pytest.mark.parametrize("name", ["buffer_size", "num_buffers"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_bad_buffer_arguments(tmp_path: Path, name: str, value: Any) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"keep me")
    t = random_bytes(10)
    with pytest.raises(ValueError, match=name):
        ckptstream.device_to_file(t, path, **{name: value})
    with pytest.raises(ValueError, match=name):
        ckptstream.file_to_device(path, t, **{name: value})
    with pytest.raises(ValueError, match=name), ckptstream.settings(**{name: value}):
        pass
    assert path.read_bytes() == b"keep me"


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="io_threads"), ckptstream.settings(io_threads=0):
        pass
    with pytest.raises(ValueError, match="direct_io"), ckptstream.settings(direct_io="yes"):
        pass
    with pytest.raises(TypeError, match="buffer_sise"), ckptstream.settings(buffer_sise=1 << 20):
        pass


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
        ckptstream.file_to_device(f, dst, buffer_size=7)
    assert as_bytes(dst) == bytes([POISON_BYTE]) * 80


# --- OS errors ----------------------------------------------------------------------------------


def test_os_errors_keep_errno_and_name_the_file(device: torch.device, tmp_path: Path) -> None:
    t = random_tensor(1000, torch.float32, device)
    missing = tmp_path / "no" / "such" / "dir.bin"
    with pytest.raises(FileNotFoundError) as info:
        ckptstream.device_to_file(t, missing)
    assert info.value.errno == errno.ENOENT and str(missing) in str(info.value)

    before = Resources.snapshot()
    with pytest.raises(IsADirectoryError) as info2:  # open succeeds; pread fails in an I/O thread
        ckptstream.file_to_device(tmp_path, t, buffer_size=1000)
    assert info2.value.errno == errno.EISDIR and str(tmp_path) in str(info2.value)
    before.assert_released()

    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info3:
            ckptstream.device_to_file(t, fd, buffer_size=1000)
        assert info3.value.errno == errno.EBADF and str(path) in str(info3.value)
    finally:
        os.close(fd)
    before.assert_released()


# --- short files --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["path", "fd", "object"])
def test_short_file(device: torch.device, tmp_path: Path, target: str) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(as_bytes(random_bytes(1000)))
    before = Resources.snapshot()

    def expect_short(file: Any, dst: torch.Tensor, offset: int | None, reported_offset: int, found: int) -> None:
        with pytest.raises(ckptstream.TruncatedFileError) as info:
            ckptstream.file_to_device(file, dst, offset=offset, buffer_size=256)
        e = info.value
        assert isinstance(e, ckptstream.CkptStreamError) and isinstance(e, EOFError)
        assert (e.path, e.offset, e.expected, e.found) == (str(path), reported_offset, nbytes(dst), found)
        for part in (str(path), f"offset {reported_offset}", str(nbytes(dst)), f"only {found}"):
            assert part in str(e)
        assert as_bytes(dst) == bytes([POISON_BYTE]) * nbytes(dst)  # checked before any byte was read

    big = poisoned_like(torch.empty(300, device=device))
    mid = poisoned_like(torch.empty(500, dtype=torch.uint8, device=device))
    if target == "path":
        expect_short(path, big, None, 0, 1000)
        expect_short(path, mid, 600, 600, 400)
        expect_short(path, mid, 5000, 5000, 0)
    elif target == "fd":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.lseek(fd, 900, os.SEEK_SET)
            expect_short(fd, mid, None, 900, 100)
            assert os.lseek(fd, 0, os.SEEK_CUR) == 900  # a failed read does not move the position
            expect_short(fd, big, 0, 0, 1000)
        finally:
            os.close(fd)
    else:
        with open(path, "rb") as f:
            f.read(900)
            expect_short(f, mid, None, 900, 100)
            assert f.tell() == 900
    before.assert_released()


@pytest.mark.parametrize("offset", [0, 100])
def test_file_shrinking_during_the_read(device: torch.device, tmp_path: Path, direct_io: bool | None,
                                        monkeypatch: pytest.MonkeyPatch, offset: int) -> None:
    """Where the size check cannot see it (the file shrinks, or is not a regular file), the I/O
    thread finds the end and reports it for the whole read."""
    path = tmp_path / "short.bin"
    path.write_bytes(as_bytes(random_bytes(1000)))
    monkeypatch.setattr(_fileio, "check_length", lambda *args: None)
    dst = poisoned_like(torch.empty(3000, dtype=torch.uint8, device=device))
    before = Resources.snapshot()
    with pytest.raises(ckptstream.TruncatedFileError) as info:
        ckptstream.file_to_device(path, dst, offset=offset, buffer_size=4096 if direct_io else 512)
    e = info.value
    assert (e.path, e.offset, e.expected, e.found) == (str(path), offset, 3000, 1000 - offset)
    before.assert_released()


# --- failures in the middle of a transfer ------------------------------------------------------


def _eio(path: str) -> OSError:
    return OSError(errno.EIO, "injected I/O error", path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [_eio, KeyboardInterrupt], ids=["EIO", "KeyboardInterrupt"])
@pytest.mark.parametrize("io_threads", [1, 3])
@pytest.mark.parametrize("k", [1, 5, 32])  # the first, a middle and the last chunk
@pytest.mark.parametrize("direction", ["write", "read"])
def test_failure_in_an_io_thread(device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 direction: str, k: int, io_threads: int, exc: Callable[[str], BaseException]) -> None:
    """The k-th pwrite/pread fails: the caller gets that exception, nothing hangs, and threads,
    buffers and descriptors are all released."""
    src = random_bytes(32 * 256, device)  # 32 chunks of 256 bytes
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(src, path, buffer_size=256, num_buffers=3)  # warm up the device
    before = Resources.snapshot()
    name = "pwrite_all" if direction == "write" else "pread_into"
    monkeypatch.setattr(_fileio, name, fail_on_call(k, getattr(_fileio, name), exc))
    expected = OSError if exc is _eio else KeyboardInterrupt
    start = time.monotonic()
    with ckptstream.settings(io_threads=io_threads), pytest.raises(expected) as info:
        if direction == "write":
            ckptstream.device_to_file(src, path, buffer_size=256, num_buffers=3)
        else:
            ckptstream.file_to_device(path, poisoned_like(src), buffer_size=256, num_buffers=3)
    assert time.monotonic() - start < 10
    if isinstance(info.value, OSError):
        assert info.value.errno == errno.EIO and info.value.filename == str(path)
    before.assert_released()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("direction", ["write", "read"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_failure_on_the_callers_side(device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     layout: str, direction: str, k: int, exc: type[BaseException]) -> None:
    """Enqueueing a chunk's device copies fails (or Ctrl-C arrives there) while I/O threads are
    busy: same cleanup, no hang. Saves enqueue from the caller's thread, loads from I/O threads."""
    base = random_tensor((64, 128), torch.float32, device)
    src = base if layout == "contiguous" else base.t()
    path = tmp_path / "t.bin"
    ckptstream.device_to_file(src, path, buffer_size=1024)  # warm up; the read below needs the file
    before = Resources.snapshot()
    real = _pipeline._copy_pieces
    calls = itertools.count(1)

    def failing(*args: Any, **kwargs: Any) -> list[torch.cuda.Event]:
        events = real(*args, **kwargs)
        if next(calls) == k:
            raise exc("injected")
        return events

    monkeypatch.setattr(_pipeline, "_copy_pieces", failing)
    with ckptstream.settings(io_threads=3, num_buffers=3), pytest.raises(exc):
        if direction == "write":
            ckptstream.device_to_file(src, path, buffer_size=1024)
        else:
            ckptstream.file_to_device(path, poisoned_like(src), buffer_size=1024)
    before.assert_released()


# --- the buffer pool ---------------------------------------------------------------------------


def test_pool_reuses_buffers(device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_bytes(50000, device)
    path = tmp_path / "t.bin"
    kw: dict[str, Any] = {"buffer_size": 3001, "num_buffers": 3}  # a size no other test uses

    def round_trip() -> None:
        ckptstream.device_to_file(src, path, **kw)
        dst = poisoned_like(src)
        ckptstream.file_to_device(path, dst, **kw)
        assert_bytes_equal(dst, src)

    round_trip()
    idle = POOL.idle_bytes()
    for _ in range(5):
        round_trip()
    assert POOL.idle_bytes() == idle and POOL.in_use == 0

    monkeypatch.setattr(_fileio, "pwrite_all", fail_on_call(2, _fileio.pwrite_all, _eio))
    with pytest.raises(OSError):
        ckptstream.device_to_file(src, path, **kw)
    assert POOL.idle_bytes() == idle and POOL.in_use == 0


def test_pool_takes_no_more_buffers_than_chunks(tmp_path: Path) -> None:
    before = POOL.idle_bytes()
    ckptstream.device_to_file(random_bytes(5000), tmp_path / "t.bin", buffer_size=3011, num_buffers=8)
    assert POOL.idle_bytes() - before == 2 * 3011


# --- settings ----------------------------------------------------------------------------------


def test_settings_scoping() -> None:
    base = ckptstream.current_settings()
    with ckptstream.settings(buffer_size=12345) as outer:
        assert ckptstream.current_settings() == outer
        assert (outer.buffer_size, outer.num_buffers, outer.io_threads) == (12345, base.num_buffers, base.io_threads)
        with ckptstream.settings(num_buffers=3, io_threads=2) as inner:
            assert (inner.buffer_size, inner.num_buffers, inner.io_threads) == (12345, 3, 2)
            assert ckptstream.current_settings() == inner
        assert ckptstream.current_settings() == outer
        with pytest.raises(ZeroDivisionError), ckptstream.settings(buffer_size=99):
            assert ckptstream.current_settings().buffer_size == 99
            _ = 1 // 0
        assert ckptstream.current_settings() == outer
        with pytest.raises(TypeError), ckptstream.settings(buffer_size=1, nope=2):
            pass
        assert ckptstream.current_settings() == outer
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(ckptstream.current_settings().buffer_size))
        thread.start()
        thread.join()
        assert seen == [base.buffer_size]  # scoped to this thread
    assert ckptstream.current_settings() == base


def test_settings_and_arguments_choose_the_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[tuple[int, int]] = []
    real = POOL.acquire

    def spy(size: int, count: int, pinned: bool) -> Any:
        taken.append((size, count))
        return real(size, count, pinned)

    monkeypatch.setattr(POOL, "acquire", spy)
    src, path = random_bytes(10000), tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=1000, num_buffers=2):
        ckptstream.device_to_file(src, path)
        ckptstream.device_to_file(src, path, buffer_size=3000)
        ckptstream.file_to_device(path, src, num_buffers=3)
    assert taken == [(1000, 2), (3000, 2), (1000, 3)]


def test_environment_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"CKPTSTREAM_BUFFER_SIZE": "12288", "CKPTSTREAM_NUM_BUFFERS": "3", "CKPTSTREAM_IO_THREADS": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for raw, direct in [("auto", None), ("1", True), ("ON", True), ("true", True), ("0", False), ("Off", False)]:
        monkeypatch.setenv("CKPTSTREAM_DIRECT_IO", raw)
        assert _settings._from_environment() == ckptstream.Settings(12288, 3, 2, direct)
    monkeypatch.setenv("CKPTSTREAM_DIRECT_IO", "maybe")
    with pytest.raises(ValueError, match="CKPTSTREAM_DIRECT_IO"):
        _settings._from_environment()
    monkeypatch.delenv("CKPTSTREAM_DIRECT_IO")
    monkeypatch.setenv("CKPTSTREAM_BUFFER_SIZE", "16M")
    with pytest.raises(ValueError, match="CKPTSTREAM_BUFFER_SIZE"):
        _settings._from_environment()
    monkeypatch.setenv("CKPTSTREAM_BUFFER_SIZE", "4096")
    monkeypatch.setenv("CKPTSTREAM_NUM_BUFFERS", "0")
    with pytest.raises(ValueError, match="num_buffers"):
        _settings._from_environment()


@pytest.mark.timeout(120)
def test_environment_is_the_default_at_import() -> None:
    env = dict(os.environ, CKPTSTREAM_BUFFER_SIZE="8192", CKPTSTREAM_NUM_BUFFERS="5",
               CKPTSTREAM_IO_THREADS="7", CKPTSTREAM_DIRECT_IO="off")
    code = "import ckptstream; s = ckptstream.current_settings(); print(s.buffer_size, s.num_buffers, s.io_threads, s.direct_io)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.split() == ["8192", "5", "7", "False"]


# --- the pipeline under the public API: many tensors packed into shared chunks ------------------


@pytest.mark.parametrize(("write_size", "read_size"), [(64, 100), (4096, 8192), (1 << 20, 1 << 20)])
def test_many_spans_back_to_back(device: torch.device, tmp_path: Path, write_size: int, read_size: int) -> None:
    """Every edge case, packed back to back from an unaligned offset: small tensors share chunks,
    large ones span several, and each lands at its own offset."""
    sources = [case.source(device) for case in EDGE_CASES]
    start = 7
    spans, offset = [], start
    for t in sources:
        spans.append(_pipeline.Span.of(t, offset))
        offset += nbytes(t)
    path = tmp_path / "packed.bin"
    cfg = ckptstream.Settings(buffer_size=write_size, num_buffers=3, io_threads=2)
    with _fileio.endpoint(path, None, writing=True) as ep:
        _pipeline.write_spans(ep, spans, cfg)
    assert path.read_bytes() == bytes(start) + b"".join(as_bytes(t) for t in sources)

    bases, dsts = [], []
    for case, t in zip(EDGE_CASES, sources, strict=True):
        base, dst = case.destination(device) if case.writable else (poisoned_like(t),) * 2
        bases.append(base)
        dsts.append(dst)
    cfg = ckptstream.Settings(buffer_size=read_size, num_buffers=2, io_threads=2)
    with _fileio.endpoint(path, 0, writing=False) as ep:
        _pipeline.read_spans(ep, [_pipeline.Span.of(d, s.offset) for d, s in zip(dsts, spans, strict=True)], cfg)
    for case, t, base, dst in zip(EDGE_CASES, sources, bases, dsts, strict=True):
        assert_bytes_equal(dst, t)
        if case.writable:
            assert_bytes_equal(base, case.expected_base(t))


def test_one_endpoint_serves_several_runs(tmp_path: Path) -> None:
    """A file kept open across transfers with different settings: each run decides O_DIRECT for
    itself (an O_DIRECT twin left by an earlier run must not be used with unaligned buffers)."""
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    src = random_bytes(20000)
    span = _pipeline.Span.of(src, 0)
    fd = os.open(tmp_path / "t.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with _fileio.endpoint(fd, 0, writing=True) as ep:
            _pipeline.write_spans(ep, [span], ckptstream.Settings(buffer_size=8192, direct_io=True))
            for cfg in (ckptstream.Settings(buffer_size=1000, direct_io=None),
                        ckptstream.Settings(buffer_size=8192, direct_io=True)):
                dst = poisoned_like(src)
                _pipeline.read_spans(ep, [_pipeline.Span.of(dst, 0)], cfg)
                assert_bytes_equal(dst, src)
    finally:
        os.close(fd)
