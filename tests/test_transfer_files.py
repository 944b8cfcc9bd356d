"""device_to_file / file_to_device on files given every way: paths, descriptors, buffered and
unbuffered objects, append mode; file positions and explicit offsets; files too short."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import DirectIO, Settings
from ckptstream._storage import fileio
from tests.helpers import (
    POISON_BYTE,
    KiB,
    Resources,
    as_bytes,
    assert_bytes_equal,
    nbytes,
    poisoned_like,
    random_bytes,
    random_tensor,
)

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
        assert ckptstream.device_to_file(t1, f.file, settings=Settings(buffer_size=1000)) == 4004
        assert f.tell() == 22 + 4004
        assert ckptstream.device_to_file(t2, f.file, settings=Settings(buffer_size=1000, num_buffers=1)) == 462
        assert f.tell() == 22 + 4004 + 462
        f.write(tail)
    finally:
        f.close()
    assert path.read_bytes() == header + as_bytes(t1) + as_bytes(t2) + tail

    f = _File(kind, path, "r")
    try:
        assert f.read(len(header)) == header  # a buffered reader has read ahead past the header
        d1, d2 = poisoned_like(t1), poisoned_like(t2.t()).t()
        assert ckptstream.file_to_device(f.file, d1, settings=Settings(buffer_size=777)) == 4004
        assert f.tell() == 22 + 4004
        assert ckptstream.file_to_device(f.file, d2, settings=Settings(buffer_size=100)) == 462
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
        ckptstream.device_to_file(t1, f, settings=Settings(buffer_size=64))
        ckptstream.device_to_file(t2, f, settings=Settings(buffer_size=64))
        f.write(b"xyz")
        f.seek(0)
        assert f.read(3) == b"abc"
        d1, d2 = poisoned_like(t1), poisoned_like(t2)
        ckptstream.file_to_device(f, d1, settings=Settings(buffer_size=50))
        ckptstream.file_to_device(f, d2, settings=Settings(buffer_size=50))
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
        many = Settings(buffer_size=1024, num_buffers=4, io_threads=4)
        assert ckptstream.device_to_file(src, f, settings=many) == 64 * KiB
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


def _offset_round_trip(target: str, path: Path, src: torch.Tensor, dst: torch.Tensor, kw: dict[str, Any]) -> None:
    """Write ``src`` and read it into ``dst`` at an explicit offset through ``target``; the
    position of a descriptor or object stays where it was."""
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


@pytest.mark.parametrize("offset", [0, 4096, 5003])
@pytest.mark.parametrize("buffer_size", [4096, 12288, 10000])
@pytest.mark.parametrize("target", ["path", "fd", "object"])
def test_explicit_offset_in_an_existing_file(device: torch.device, tmp_path: Path, direct_io: DirectIO,
                                             target: str, buffer_size: int, offset: int) -> None:
    """Positional I/O: only [offset, offset + n) changes, the file position stays where it was."""
    path = tmp_path / "t.bin"
    existing = as_bytes(random_bytes(30011))
    path.write_bytes(existing)
    src = random_tensor(2500, torch.float32, device)  # 10000 bytes: ends inside a page
    dst = poisoned_like(src)
    if direct_io is DirectIO.ON and buffer_size % 4096:
        with pytest.raises(ValueError, match="multiple of 4096"), ckptstream.settings(buffer_size=buffer_size):
            ckptstream.device_to_file(src, path, offset=offset)
        assert path.read_bytes() == existing
        return
    kw: dict[str, Any] = {"offset": offset, "settings": Settings(buffer_size=buffer_size, direct_io=direct_io)}
    _offset_round_trip(target, path, src, dst, kw)
    assert path.read_bytes() == existing[:offset] + as_bytes(src) + existing[offset + 10000:]
    assert_bytes_equal(dst, src)


@pytest.mark.usefixtures("direct_io")
def test_offset_past_the_end_extends_the_file(device: torch.device, tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 100)
    src = random_bytes(5000, device)
    assert ckptstream.device_to_file(src, path, offset=8195, settings=Settings(buffer_size=4096)) == 5000
    assert path.read_bytes() == b"x" * 100 + bytes(8095) + as_bytes(src)


# --- short files --------------------------------------------------------------------------------


def _expect_short(file: Any, path: Path, dst: torch.Tensor, offset: int | None, reported_offset: int,
                  found: int) -> None:
    with pytest.raises(ckptstream.TruncatedFileError) as info:
        ckptstream.file_to_device(file, dst, offset=offset, settings=Settings(buffer_size=256))
    e = info.value
    assert isinstance(e, ckptstream.CkptStreamError)
    assert isinstance(e, EOFError)
    assert (e.path, e.offset, e.expected, e.found) == (str(path), reported_offset, nbytes(dst), found)
    for part in (str(path), f"offset {reported_offset}", str(nbytes(dst)), f"only {found}"):
        assert part in str(e)
    assert as_bytes(dst) == bytes([POISON_BYTE]) * nbytes(dst)  # checked before any byte was read


@pytest.mark.parametrize("target", ["path", "fd", "object"])
def test_short_file(device: torch.device, tmp_path: Path, target: str) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(as_bytes(random_bytes(1000)))
    before = Resources.snapshot()
    big = poisoned_like(torch.empty(300, device=device))
    mid = poisoned_like(torch.empty(500, dtype=torch.uint8, device=device))
    if target == "path":
        _expect_short(path, path, big, None, 0, 1000)
        _expect_short(path, path, mid, 600, 600, 400)
        _expect_short(path, path, mid, 5000, 5000, 0)
    elif target == "fd":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.lseek(fd, 900, os.SEEK_SET)
            _expect_short(fd, path, mid, None, 900, 100)
            assert os.lseek(fd, 0, os.SEEK_CUR) == 900  # a failed read does not move the position
            _expect_short(fd, path, big, 0, 0, 1000)
        finally:
            os.close(fd)
    else:
        with open(path, "rb") as f:
            f.read(900)
            _expect_short(f, path, mid, None, 900, 100)
            assert f.tell() == 900
    before.assert_released()


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("offset", [0, 100])
def test_file_shrinking_during_the_read(device: torch.device, tmp_path: Path, direct_io: DirectIO,
                                        monkeypatch: pytest.MonkeyPatch, offset: int, layout: str) -> None:
    """Where the size check cannot see it (the file shrinks, or is not a regular file), the I/O
    thread finds the end and reports it for the whole read (read straight into a host tensor,
    or through the staging buffers)."""
    path = tmp_path / "short.bin"
    path.write_bytes(as_bytes(random_bytes(1000)))
    monkeypatch.setattr(fileio, "check_length", lambda *args: None)
    base = poisoned_like(torch.empty(60, 50, dtype=torch.uint8, device=device))
    dst = base if layout == "contiguous" else base.t()
    before = Resources.snapshot()
    with pytest.raises(ckptstream.TruncatedFileError) as info:
        ckptstream.file_to_device(path, dst, offset=offset,
                                  settings=Settings(buffer_size=4096 if direct_io is DirectIO.ON else 512,
                                                    direct_io=direct_io))
    e = info.value
    assert (e.path, e.offset, e.expected, e.found) == (str(path), offset, 3000, 1000 - offset)
    before.assert_released()
