"""File access under the pipeline: open (O_DIRECT where allowed), checked pwrite/pread loops,
fsync, atomic publish. Everything that touches a file descriptor lives here."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import io
import os
import socket
import stat
import uuid
from collections.abc import Iterator
from typing import IO, Union

from ._errors import TruncatedFileError

ALIGN = 4096  # O_DIRECT alignment of buffer address, length and file offset
FileLike = Union[str, "os.PathLike[str]", int, IO[bytes]]


def round_down(value: int, align: int) -> int:
    return value - value % align


def round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def describe_fd(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"file descriptor {fd}"


def os_error(e: OSError, what: str, path: str) -> OSError:
    """The same OS error (errno and subclass kept) with the path and operation in its message."""
    return OSError(e.errno, f"{e.strerror} ({what})", path)


@dataclasses.dataclass
class Endpoint:
    """One open file for one transfer: a buffered fd, maybe an O_DIRECT twin, where to start."""

    fd: int
    path: str
    start: int
    direct_fd: int | None = None
    owned: bool = False

    def close(self) -> None:
        """Close the O_DIRECT twin, and the fd itself if this endpoint opened it."""
        if self.direct_fd is not None:
            fd, self.direct_fd = self.direct_fd, None
            os.close(fd)
        if self.owned:
            self.owned = False
            os.close(self.fd)


def reopen(fd: int, flags: int) -> int:
    """A new open file description of ``fd``'s file with ``flags`` (Linux /proc/self/fd)."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def open_direct(fd: int, path: str, force: bool) -> int | None:
    """Reopen ``fd`` with O_DIRECT and the same access mode (a read-only fd stays read-only);
    None where the file system refuses O_DIRECT (tmpfs) and not forced."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        if force:
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform", path)
        return None
    try:
        return reopen(fd, fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE | direct)
    except OSError as e:
        if force:
            raise os_error(e, "opening with O_DIRECT (direct_io=True)", path) from e
        return None


@contextlib.contextmanager
def endpoint(file: FileLike, offset: int | None, writing: bool) -> Iterator[Endpoint]:
    """Open ``file`` for one transfer starting at ``offset`` (None: the file's current position,
    or 0 for a path); descriptors opened here are closed on exit. Moving the file's position
    after a successful transfer is ``advance_position``'s job."""
    if offset is not None and (not isinstance(offset, int) or offset < 0):
        raise ValueError(f"offset must be a non-negative int or None, got {offset!r}")
    if isinstance(file, (str, os.PathLike)):
        path = os.fsdecode(file)
        flags = (os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset is None else 0)) if writing else os.O_RDONLY
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise os_error(e, "opening for writing" if writing else "opening for reading", path) from e
        ep = Endpoint(fd, path, offset or 0, owned=True)
    elif isinstance(file, int) and not isinstance(file, bool):
        ep = Endpoint(file, describe_fd(file), offset if offset is not None else os.lseek(file, 0, os.SEEK_CUR))
    elif not isinstance(file, int) and hasattr(file, "fileno"):
        if not getattr(file, "closed", False):
            file.flush()  # the object's own buffered writes must land before we touch the file
        fd = file.fileno()
        name = getattr(file, "name", None)
        ep = Endpoint(fd, name if isinstance(name, str) else describe_fd(fd), offset if offset is not None else file.tell())
    else:
        raise TypeError(f"file must be a path, an int file descriptor or a binary file object, got {type(file).__name__}")
    twin, flags = None, fcntl.fcntl(ep.fd, fcntl.F_GETFL)
    if writing and not ep.owned and flags & os.O_APPEND:
        # Linux pwrite ignores the offset on an O_APPEND descriptor and appends: write through a
        # twin without O_APPEND; "the current position" of an appending file is its end
        if offset is None:
            ep.start = os.fstat(ep.fd).st_size
        twin = ep.fd = reopen(ep.fd, flags & os.O_ACCMODE)
    try:
        yield ep
    finally:
        ep.close()
        if twin is not None:
            os.close(twin)


def advance_position(file: FileLike, offset: int | None, new_position: int) -> None:
    """After a successful transfer with ``offset=None``, leave the file's position past the bytes."""
    if offset is not None or isinstance(file, (str, os.PathLike)):
        return
    if isinstance(file, int):
        os.lseek(file, new_position, os.SEEK_SET)
    else:
        file.seek(new_position, io.SEEK_SET)  # also drops a reader's stale read-ahead buffer


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


def pread_into(fd: int, view: memoryview, offset: int, path: str) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; returns bytes read."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise os_error(e, f"reading {len(view) - done} bytes at offset {offset + done}", path) from e
        if n == 0:
            break
        done += n
    return done


def check_length(fd: int, path: str, offset: int, nbytes: int) -> None:
    """Fail before any device work when a regular file is too short for the read."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_size < offset + nbytes:
        raise TruncatedFileError(path, offset, nbytes, max(0, st.st_size - offset))


def fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        raise os_error(e, "fsync", path) from e


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMP_MARK = ".ckptstream-tmp-"


def temp_path_for(path: str) -> str:
    """A unique temp name beside ``path``, naming the writer's host and pid so that a later
    writer can tell a stale one (its writer gone) from a live one."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def remove_stale_temps(path: str) -> list[str]:
    """Delete temp files of ``path`` left by writers on this host that no longer run."""
    directory, name = os.path.split(path)
    prefix = f".{name}{TEMP_MARK}{socket.gethostname()}-"
    removed = []
    for entry in os.listdir(directory or "."):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))
                removed.append(entry)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish(temp: str, path: str) -> None:
    """Atomically replace ``path`` by the fsynced ``temp`` and make the rename durable."""
    os.replace(temp, path)
    fsync_dir(os.path.dirname(path))
