"""The local file system as a storage (``LOCAL``), and the transfer primitive's own entry point
for the files it takes: paths, int descriptors and binary file objects (``opened``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import shutil
import stat
from collections.abc import Iterator
from typing import IO, TypeVar, Union

from . import fileio, publish
from .base import Entry, Kind, Storage
from .files import AtomicSink, FileSink, FileSource
from .locks import FileLock

FileLike = Union[str, "os.PathLike[str]", int, IO[bytes]]
Opened = TypeVar("Opened", FileSink, FileSource)


class LocalStorage(Storage):
    """Paths of the local file system. Files are written beside their final name and published
    by rename (``files.AtomicSink``); nothing that is not a regular file is opened, and a FIFO
    is refused without waiting for its other end. Writer locks are lock files held with
    ``flock`` (``locks``)."""

    def open(self, path: str) -> FileSource:
        return FileSource(fileio.open_path(path, os.O_RDONLY, "opening the checkpoint"), path, owned=True)

    def create(self, path: str) -> AtomicSink:
        return AtomicSink(path)

    def check_target(self, path: str) -> str:
        return publish.check_target(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def kind(self, path: str) -> Kind | None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        return "file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode) else "other"

    def list_folder(self, folder: str) -> list[Entry]:
        with os.scandir(folder) as it:  # temps are what unfinished writes left: no entries
            entries = [Entry(e.name, _kind(e)) for e in it if publish.temp_target(e.name) is None]
        return sorted(entries, key=lambda e: e.name)

    def remove(self, path: str, *, missing_ok: bool = False) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def remove_tree(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(folder)

    def remove_folder(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(folder)

    def make_folders(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)

    def sync_folder(self, folder: str) -> None:
        fileio.fsync_dir(folder)

    def remove_temps(self, path: str, *, stale_only: bool = True) -> list[str]:
        return publish.remove_stale_temps(path, stale_only)

    def unfinished(self, folder: str) -> list[str]:
        return publish.temps_targets(folder)

    def read_small(self, path: str, limit: int) -> bytes:
        fd = fileio.open_path(path, os.O_RDONLY, "opening for reading")
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise OSError(errno.EFBIG, f"holds {size} bytes, more than the {limit} expected of it", path)
            data = bytearray(size + 1)  # a byte more: a file that grew since is seen
            got = fileio.pread_into(fd, memoryview(data), 0, path)
            if got > size:
                raise OSError(errno.EAGAIN, "grew while it was read; it is being written in place", path)
            return bytes(data[:got])
        finally:
            os.close(fd)

    def lock(self, path: str, holder: bytes) -> FileLock:
        return FileLock(path, holder)

    def absolute(self, path: str) -> str:
        return os.path.abspath(path)

    def join(self, folder: str, *names: str) -> str:
        return os.path.join(folder, *names)


def _kind(entry: os.DirEntry[str]) -> Kind:
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "folder" if entry.is_dir(follow_symlinks=False) else "other"


LOCAL = LocalStorage()


# --- the transfer primitive's files --------------------------------------------------------------


@contextlib.contextmanager
def opened(file: FileLike, offset: int | None, kind: type[Opened]) -> Iterator[tuple[Opened, int]]:
    """``file`` open for one transfer as a ``FileSink`` or a ``FileSource`` (``kind``), and where
    the transfer starts (``offset``, or for None the file's current position, 0 for a path); a
    path is opened in place (created, and truncated when ``offset`` is None), and may name a
    block device; descriptors opened here are closed on exit. Moving the file's position after
    a successful transfer is ``advance_position``'s job."""
    writing = kind is FileSink
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool) or offset < 0):
        raise ValueError(f"offset must be a non-negative int or None, got {offset!r}")
    if isinstance(file, (str, bytes, os.PathLike)):
        path = os.fsdecode(file)
        flags = (os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset is None else 0)) if writing else os.O_RDONLY
        fd = fileio.open_path(path, flags, "opening for writing" if writing else "opening for reading", devices=True)
        handle, start = kind(fd, path, owned=True), offset or 0
    elif isinstance(file, int) and not isinstance(file, bool):
        handle = kind(file, fileio.fd_path(file))
        start = offset if offset is not None else os.lseek(file, 0, os.SEEK_CUR)
    elif not isinstance(file, int) and hasattr(file, "fileno"):
        if not getattr(file, "closed", False):
            file.flush()  # the object's own buffered writes must land before we touch the file
        fd = file.fileno()
        name = getattr(file, "name", None)
        handle = kind(fd, name if isinstance(name, str) else fileio.fd_path(fd))
        start = offset if offset is not None else file.tell()
    else:
        raise TypeError("file must be a path, an int file descriptor or a binary file object, "
                        f"got {type(file).__name__}")
    twin = None
    try:
        flags = fcntl.fcntl(handle.fd, fcntl.F_GETFL)
        if writing and not handle.owned and flags & os.O_APPEND:
            # Linux pwrite ignores the offset on an O_APPEND descriptor and appends: write through
            # a twin without O_APPEND; "the current position" of an appending file is its end
            if offset is None:
                start = os.fstat(handle.fd).st_size
            twin = handle.fd = fileio.reopen(handle.fd, flags & os.O_ACCMODE)
        yield handle, start
    finally:
        handle.close()
        if twin is not None:
            os.close(twin)


def advance_position(file: FileLike, offset: int | None, new_position: int) -> None:
    """After a successful transfer with ``offset=None``, leave the file's position past the bytes."""
    if offset is not None or isinstance(file, (str, bytes, os.PathLike)):
        return
    if isinstance(file, int):
        os.lseek(file, new_position, os.SEEK_SET)
    else:
        file.seek(new_position, io.SEEK_SET)  # also drops a reader's stale read-ahead buffer

