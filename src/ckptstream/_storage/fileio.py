"""Local files' descriptors: opening (refusing FIFOs and devices without blocking, an O_DIRECT
twin where allowed), checked pwrite / pread loops, fsync, page-cache residency. The local
storage (``local``) is made of these; publishing a file atomically is ``publish``'s job."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import stat
from collections.abc import Sequence

from .._errors import TruncatedFileError
from .base import round_down


def fd_path(fd: int) -> str:
    """What a descriptor points to, for messages."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"file descriptor {fd}"


def os_error(e: OSError, what: str, path: str) -> OSError:
    """The same OS error (errno and subclass kept) with the path and operation in its message."""
    return OSError(e.errno, f"{e.strerror} ({what})", path)


def reopen(fd: int, flags: int) -> int:
    """A new open file description of ``fd``'s file with ``flags`` (Linux /proc/self/fd)."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def open_direct(fd: int, path: str, force: bool) -> int | None:
    """``fd``'s file reopened with O_DIRECT (a read-only fd stays read-only); None where the file
    system refuses it and not ``force``."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        if force:
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform (direct_io='on')", path)
        return None
    try:
        return reopen(fd, fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE | direct)
    except OSError as e:
        if force:
            raise os_error(e, "opening with O_DIRECT (direct_io='on'; use 'auto' to fall back)", path) from e
        return None


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def check_file_type(st: os.stat_result, path: str, hint: str, devices: bool = False) -> None:
    """Refuse what is not a regular file (nor, with ``devices``, a block device): the transfers
    read and write at offsets, and opening a FIFO blocks until its other end is opened."""
    if stat.S_ISREG(st.st_mode) or (devices and stat.S_ISBLK(st.st_mode)):
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory; give the path of a file", path)
    kind = _KINDS.get(stat.S_IFMT(st.st_mode), "something else")
    raise OSError(errno.EINVAL, f"is {kind}, not a regular file; {hint}", path)


def open_path(path: str, flags: int, what: str, devices: bool = False) -> int:
    """Open ``path`` (created with the mode ``open()`` gives under the umask), refusing anything
    but a regular file (or, with ``devices``, a block device) without blocking: the type is
    checked before the open, and again on the descriptor, which is opened non-blocking in case
    the path changed in between."""
    hint = ("ckptstream writes files at offsets: give a regular file" if flags & os.O_ACCMODE else
            "ckptstream reads files at offsets: copy the data to a regular file first")
    try:
        st: os.stat_result | None = os.stat(path)
    except OSError:
        st = None  # missing (created below) or unreachable (the open below says why)
    if st is not None:
        check_file_type(st, path, hint, devices)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise os_error(e, what, path) from e
    try:
        check_file_type(os.fstat(fd), path, hint, devices)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def close_strays(path: str) -> None:
    """Close every descriptor of this process on the file at ``path`` (a temp with a random name,
    which nothing else opens): an exception raised between an ``open()`` returning and its
    descriptor being stored (a Ctrl-C under a program's own SIGINT handler) leaves one unrecorded."""
    try:
        st = os.lstat(path)
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            fd = int(name)
            other = os.fstat(fd)
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                os.close(fd)


def pwrite_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Write all of ``view`` at ``offset``; short writes are continued, errors name the path."""
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise os_error(e, f"writing {len(view) - done} bytes at offset {offset + done}", path) from e
        if n == 0:
            raise OSError(errno.EIO, f"write returned 0 at offset {offset + done}", path)
        done += n


def pread_into(fd: int, view: memoryview, offset: int, path: str, request: int | None = None) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends (in calls of at most
    ``request`` bytes where given); returns bytes read."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done : done + request] if request else view[done:]], offset + done)
        except OSError as e:
            raise os_error(e, f"reading {len(view) - done} bytes at offset {offset + done}", path) from e
        if n == 0:
            break
        done += n
    return done


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def preadv_all(fd: int, views: Sequence[memoryview], offset: int, path: str, request: int | None = None) -> int:
    """Read into ``views`` one after another from ``offset`` (few calls for many small
    buffers, each of at most ``request`` bytes where given) until all are full or the file
    ends; returns bytes read."""
    done, total = 0, sum(len(v) for v in views)
    first, skip = 0, 0  # the first view not yet full, and how much of it is
    while done < total:
        batch = [views[first][skip:], *views[first + 1 : first + IOV_MAX]]
        if request:
            batch = _first_bytes(batch, request)
        try:
            n = os.preadv(fd, batch, offset + done)
        except OSError as e:
            raise os_error(e, f"reading {total - done} bytes at offset {offset + done}", path) from e
        if n == 0:
            break
        done += n
        n += skip
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        skip = n
    return done


def _first_bytes(views: list[memoryview], count: int) -> list[memoryview]:
    """The views that hold the first ``count`` bytes of ``views``, the last one cut."""
    out = []
    for view in views:
        if count <= 0:
            break
        out.append(view[:count])
        count -= len(out[-1])
    return out


def pages_in_memory(addr: int, size: int) -> bytes | None:
    """Per page of the mapped bytes at ``addr`` (page-aligned), non-zero where it is in memory
    (mincore); None where the kernel cannot tell."""
    mincore = getattr(_libc(), "mincore", None)
    if mincore is None:
        return None
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    return bytes(vec) if mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0 else None


SAMPLES, SAMPLE = 64, 1 << 20  # what resident_fraction looks at of a larger range: 64 windows of 1 MiB


def resident_fraction(fd: int, offset: int, length: int) -> float | None:
    """The fraction of the file's bytes offset..offset+length in the page cache (mincore over a
    private mapping: nothing is read); None where it cannot be told. Beyond SAMPLES x SAMPLE
    bytes, an estimate from that many windows spread evenly over the range: mincore walks the
    page tables at about 5 ms per GiB, a third of a hot 8 GiB load into a GPU where it looked at
    every page (docs/benchmarks.md)."""
    start = round_down(offset, mmap.PAGESIZE)
    size = offset + length - start
    if length <= 0:
        return None
    try:
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, ValueError):
        return None
    try:
        anchor = ctypes.c_char.from_buffer(mapped)  # its address; the mapping stays unread
        try:
            base, found, total = ctypes.addressof(anchor), 0, 0
            for at, n in _windows(size):
                pages = pages_in_memory(base + at, n)
                if pages is None:
                    return None
                found, total = found + len(pages) - pages.count(0), total + len(pages)
        finally:
            del anchor  # the mapping cannot close while a ctypes object points into it
    finally:
        mapped.close()
    return found / total


def _windows(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the page-aligned windows of a mapping of ``size`` bytes to look at."""
    if size <= SAMPLES * SAMPLE:
        return [(0, size)]
    step = (size - SAMPLE) // (SAMPLES - 1)
    return [(round_down(i * step, mmap.PAGESIZE), SAMPLE) for i in range(SAMPLES)]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def check_length(fd: int, path: str, offset: int, nbytes: int) -> None:
    """Fail before any device work when a regular file is too short for the read."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_size < offset + nbytes:
        raise TruncatedFileError(path, offset, nbytes, max(0, st.st_size - offset))


def fsync(fd: int, path: str, what: str = "fsync") -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        raise os_error(e, what, path) from e


def fsync_dir(directory: str, what: str = "fsync") -> None:
    fd = open_dir(directory)
    try:
        fsync(fd, directory, what)
    finally:
        os.close(fd)


def open_dir(directory: str) -> int:
    try:
        return os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise os_error(e, "opening the directory to fsync it", directory) from e


def aligned_like(view: memoryview, offset: int, align: int) -> bool:
    """Whether ``view``'s memory address agrees with ``offset`` modulo ``align``, so that the
    bytes of aligned offsets lie at aligned addresses (O_DIRECT needs both). A slice of a
    staging buffer whose byte 0 stands for an aligned offset does; a read-only buffer (bytes)
    is never written to by the kernel and is not taken for one."""
    if view.readonly or not len(view):
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return (address - offset) % align == 0

