"""O_DIRECT: which transfers use it under each ``direct_io`` mode, its alignment rule, the
access mode of its descriptor, and one open file serving engines with different settings."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

import ckptstream
from ckptstream import DirectIO, Settings
from ckptstream._engine import Piece, ReadEngine, WriteEngine
from ckptstream._storage import fileio, local
from ckptstream._storage.files import FileSink, FileSource
from tests.helpers import as_bytes, assert_bytes_equal, direct_io_supported, poisoned_like, random_bytes


def test_direct_io_setting_decides_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    opened: list[bool] = []
    real = fileio.open_direct

    def spy(fd: int, path: str, force: bool) -> int | None:
        direct_fd = real(fd, path, force)
        assert direct_fd is not None
        opened.append(bool(fcntl.fcntl(direct_fd, fcntl.F_GETFL) & os.O_DIRECT))
        return direct_fd

    monkeypatch.setattr(fileio, "open_direct", spy)
    src = random_bytes(20000)
    path = tmp_path / "t.bin"

    def round_trip(buffer_size: int) -> list[bool]:
        opened.clear()
        with ckptstream.settings(buffer_size=buffer_size):  # and the direct_io of the scope around
            ckptstream.device_to_file(src, path)
            dst = poisoned_like(src)
            ckptstream.file_to_device(path, dst)
        assert_bytes_equal(dst, src)
        return list(opened)

    with ckptstream.settings(direct_io="off"):
        assert round_trip(8192) == []
    with ckptstream.settings(direct_io="on"):
        assert round_trip(8192) == [True, True]
    with ckptstream.settings(direct_io="auto"):
        assert round_trip(8192) == [True]  # writes only: reads keep the page cache
        assert round_trip(10000) == []  # unaligned buffers cannot go direct


@pytest.mark.parametrize("offset", [0, 4096 + 7])
def test_direct_io_on_moves_every_chunk_through_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         offset: int) -> None:
    """Under direct_io='on' the staged chunks move through the O_DIRECT twin (whole blocks;
    the unaligned edges of a write go buffered), not silently through the page cache."""
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    calls: list[tuple[str, bool, int, int]] = []  # (call, O_DIRECT?, offset, bytes)

    def spy(name: str) -> Any:
        real = getattr(fileio, name)

        def call(fd: int, view: memoryview, at: int, path: str) -> Any:
            calls.append((name, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), at, len(view)))
            return real(fd, view, at, path)
        return call

    for name in ("pwrite_all", "pread_into"):
        monkeypatch.setattr(fileio, name, spy(name))
    src = random_bytes(6 * 4096 + 123)
    path = tmp_path / "t.bin"
    with ckptstream.settings(direct_io="on", buffer_size=8192, num_buffers=2):
        ckptstream.device_to_file(src, path, offset=offset)
        dst = poisoned_like(src.view(-1, 1)).t()  # non-contiguous: through the staging buffers
        ckptstream.file_to_device(path, dst, offset=offset)
    assert_bytes_equal(dst, src.view(1, -1))
    writes = [(d, at, n) for name, d, at, n in calls if name == "pwrite_all" and n]
    reads = [(d, at, n) for name, d, at, n in calls if name == "pread_into"]
    assert all(d == (at % 4096 == 0 and n % 4096 == 0) for d, at, n in writes), writes  # aligned: direct
    assert sum(n for d, _, n in writes if d) >= len(src) - 2 * 4096
    assert reads
    assert all(d and at % 4096 == 0 and n % 4096 == 0 for d, at, n in reads), reads


def test_direct_io_needs_aligned_buffers(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"keep me")
    src = random_bytes(100)
    with pytest.raises(ValueError, match="multiple of 4096"):
        ckptstream.device_to_file(src, path, settings=ckptstream.Settings(buffer_size=10000, direct_io="on"))
    with pytest.raises(ValueError, match="multiple of 4096"):
        ckptstream.file_to_device(path, src, settings=ckptstream.Settings(buffer_size=4097, direct_io="on"))
    with ckptstream.settings(direct_io="on"), pytest.raises(ValueError, match="multiple of 4096"), \
            ckptstream.settings(buffer_size=10000):
        pass
    with pytest.raises(ValueError, match="multiple of 4096"), ckptstream.settings(direct_io="on", buffer_size=5000):
        pass
    assert path.read_bytes() == b"keep me"  # rejected before the file was opened (and truncated)


def test_direct_io_keeps_a_read_only_descriptor_read_only(tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        one_block = ckptstream.Settings(buffer_size=4096, direct_io="on")
        with pytest.raises(OSError, match="Bad file descriptor") as info:
            ckptstream.device_to_file(random_bytes(4096), fd, offset=0, settings=one_block)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(8192)


def test_one_open_file_serves_several_engines(tmp_path: Path) -> None:
    """A file kept open across transfers with different settings: each engine decides O_DIRECT
    for itself (an O_DIRECT twin left by an earlier engine must not be used with unaligned
    buffers), for writes and for reads."""
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    settings = (Settings(buffer_size=8192, direct_io=DirectIO.ON), Settings(buffer_size=1000, direct_io=DirectIO.AUTO),
                Settings(buffer_size=8192, direct_io=DirectIO.ON))
    fd = os.open(tmp_path / "t.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with local.opened(fd, 0, FileSink) as (sink, start):
            for cfg in settings:
                src = random_bytes(20000)
                WriteEngine(sink, [Piece.of(src, start)], cfg).run()
                assert (tmp_path / "t.bin").read_bytes() == as_bytes(src)
        with local.opened(fd, 0, FileSource) as (source, start):
            for cfg in settings:
                dst = poisoned_like(src.view(100, 200)).t()  # through the staging buffers
                ReadEngine(source, [Piece.of(dst, start)], cfg).run()
                assert_bytes_equal(dst, src.view(200, 100))
    finally:
        os.close(fd)
