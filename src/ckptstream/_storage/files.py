"""Local files as sinks and sources: positional I/O on a descriptor and its O_DIRECT twin, and
the atomic publication of a new file (``AtomicSink``).

O_DIRECT is a transfer's choice (``grid``): with it, a write's aligned middle goes through the
twin and its unaligned edges are written buffered (padding the edges instead would overwrite
bytes that follow in an existing file), and reads take whole aligned blocks; memory that is not
aligned like its offsets (a header in a bytes object) is written and read buffered.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Sequence
from typing import Literal

from .._settings import ALIGN, DirectIO
from . import fileio, publish
from .base import Sink, Source, round_down, round_up
from .mapping import Mapping

log = logging.getLogger(__name__)


class _Descriptor:
    """A descriptor of a local file and, opened on first use, its O_DIRECT twin."""

    def __init__(self, fd: int, path: str, *, owned: bool = False, name: str | None = None) -> None:
        self.fd = fd
        self.path = path  # the file the descriptor is open on, for OS errors
        self.name = path if name is None else name
        self.owned = owned  # opened by ckptstream: closed by ``close``
        self._direct_fd: int | None = None
        self._direct_refused = False
        self._direct_forced = False  # direct_io='on': a refused direct write is an error
        self._direct_writes_refused = False
        self._in_use: int | None = None  # the twin, where the current transfer takes it

    def direct_fd(self, force: bool) -> int | None:
        """The file reopened with O_DIRECT and the same access mode, opened on first use; None
        where the file system refuses O_DIRECT (tmpfs) and ``force`` is False."""
        self._direct_forced = force
        if self._direct_fd is None and not self._direct_refused:
            self._direct_fd = fileio.open_direct(self.fd, self.path, force)
            self._direct_refused = self._direct_fd is None
        return self._direct_fd

    def close(self) -> None:
        """Close the O_DIRECT twin, and the descriptor itself if ckptstream opened it; safe to
        call twice."""
        self._in_use = None
        if self._direct_fd is not None:
            fd, self._direct_fd = self._direct_fd, None
            os.close(fd)
        if self.owned:
            self.owned = False
            os.close(self.fd)


class FileSink(_Descriptor, Sink):
    """Positional writes to an open file, in place (the transfer primitive's files);
    ``publish`` fsyncs a file that ckptstream opened. ``AtomicSink`` publishes a new file."""

    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        """O_DIRECT for writes under 'on', and under 'auto' where the buffers are whole blocks
        and the file system takes it: chunks then lie on its 4096-byte grid."""
        use = direct_io is DirectIO.ON or (direct_io is DirectIO.AUTO and buffer_size % ALIGN == 0)
        self._in_use = self.direct_fd(force=direct_io is DirectIO.ON) if use else None
        log.debug("%s: %s writes (direct_io=%s, buffer_size %d%s)", self.path,
                  "O_DIRECT" if self._in_use is not None else "buffered", direct_io.value, buffer_size,
                  ", refused by the file system" if use and self._in_use is None else "")
        return ALIGN if self._in_use is not None else 1

    def write_at(self, view: memoryview, offset: int) -> None:
        if self._in_use is not None:
            a_lo, a_hi = round_up(offset, ALIGN), round_down(offset + len(view), ALIGN)
            if a_lo < a_hi and fileio.aligned_like(view, offset, ALIGN):
                self._pwrite_direct(view[a_lo - offset : a_hi - offset], a_lo)
                fileio.pwrite_all(self.fd, view[: a_lo - offset], offset, self.path)
                fileio.pwrite_all(self.fd, view[a_hi - offset :], a_hi, self.path)
                return
        fileio.pwrite_all(self.fd, view, offset, self.path)

    def _pwrite_direct(self, view: memoryview, offset: int) -> None:
        """Write aligned bytes through the O_DIRECT twin. Some file systems accept the O_DIRECT
        open and refuse the writes (EINVAL): unless forced, those bytes, and the file's later
        ones, are written buffered instead (the same bytes at the same offsets)."""
        fd = self._direct_fd
        if fd is not None and not self._direct_writes_refused:
            try:
                fileio.pwrite_all(fd, view, offset, self.path)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                if self._direct_forced:
                    raise OSError(errno.EINVAL, f"the file system refuses O_DIRECT writes ({e.strerror}; "
                                  "direct_io='on'; use 'auto' to fall back to buffered writes)", self.path) from e
                self._direct_writes_refused = True
                log.debug("%s: O_DIRECT writes refused (%s); the rest buffered", self.path, e.strerror)
        fileio.pwrite_all(self.fd, view, offset, self.path)

    def publish(self) -> None:
        if self.owned:
            fileio.fsync(self.fd, self.path)
        self.close()

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            self.close()


class AtomicSink(FileSink):
    """A new temp file beside the file ``path`` names (see ``publish``). ``publish`` gives it
    the old file's mode and owner, fsyncs it, renames it over the old file and fsyncs the
    directory (``seal`` takes the first steps early); ``abandon`` (or a failed step) removes it
    and leaves the old file untouched.
    (When the directory's fsync fails, the rename has happened: the new file is in place,
    complete, and the error says that a crash could still undo the rename.)"""

    def __init__(self, path: str) -> None:
        target, self._old = publish.target_of(path)
        self.target, self._directory = target, os.path.dirname(target)
        self._state: Literal["open", "sealed", "published", "abandoned"] = "open"
        publish.remove_stale_temps(target)
        self._dir_fd: int | None = fileio.open_dir(self._directory)  # before any byte: the last step needs it
        try:
            temp = publish.temp_path_for(target)
            try:
                # a file being replaced keeps its mode, set at the end; until then the temp is private
                mode = 0o600 if self._old is not None else 0o666
                try:
                    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
                except OSError as e:
                    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # of the folder: the temp is new
                        raise OSError(e.errno, f"{e.strerror}: the folder {self._directory} is not writable, so "
                                      "the file cannot be created there; save into a writable folder (or make this "
                                      "one writable)", target) from e
                    raise fileio.os_error(e, "creating the temp file", temp) from e
                super().__init__(fd, temp, owned=True, name=target)
            except BaseException:
                publish.discard(temp)  # also a descriptor an interrupt left unrecorded
                raise
        except BaseException:
            self._close_dir()
            raise

    def seal(self) -> None:
        """Give the temp the old file's mode and owner, fsync it and close its descriptors and
        the directory's: ``publish`` then renames it and fsyncs the directory."""
        if self._state != "open":
            return
        try:
            self._make_durable()
        except BaseException:
            self.abandon()
            raise
        self._state = "sealed"
        self._close_dir()

    def _make_durable(self) -> None:
        if self._old is not None:
            publish.keep_owner_and_mode(self.fd, self._old)
        fileio.fsync(self.fd, self.path)
        self.close()
        self.fd = -1  # a stray write after this fails (EBADF) instead of landing in a file that reused the number

    def publish(self) -> None:
        if self._state == "published":
            return
        if self._state == "abandoned":
            raise ValueError(f"{self.target}: the new file was abandoned; it cannot be published")
        sealed, self._state = self._state == "sealed", "published"
        try:
            try:
                if sealed:  # the directory is opened before the rename, so that its fsync cannot fail to open
                    self._dir_fd = fileio.open_dir(self._directory)
                else:
                    self._make_durable()
                try:
                    os.replace(self.path, self.target)
                except OSError as e:
                    raise fileio.os_error(e, f"renaming the temp file over {self.target}", self.path) from e
            except BaseException:
                self._discard()
                raise
            assert self._dir_fd is not None
            fileio.fsync(self._dir_fd, self._directory, f"fsync of the directory after renaming the new file into "
                         f"place: {self.target} is the new file, complete, but a crash may still undo the rename")
        finally:
            self._close_dir()

    def abandon(self) -> None:
        if self._state not in ("open", "sealed"):
            return
        self._state = "abandoned"
        try:
            self._discard()
        finally:
            self._close_dir()

    def _discard(self) -> None:
        """Close the temp's descriptors, also any an interrupt left unrecorded, and remove it."""
        try:
            with contextlib.suppress(OSError):
                self.close()
        finally:
            publish.discard(self.path)

    def _close_dir(self) -> None:
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            os.close(fd)


READ_REQUEST = 2 << 20  # the fastest cold reads on a virtual disk: docs/benchmarks.md


class FileSource(_Descriptor, Source):
    """Positional reads of an open file (a checkpoint, or the transfer primitive's file)."""

    sequential_readers = True
    request: int | None = None  # the most bytes one read call asks for (None: all at once)

    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        """O_DIRECT for reads under 'on' only (reads keep the page cache otherwise): whole
        aligned blocks then."""
        self._in_use = self.direct_fd(force=True) if direct_io is DirectIO.ON else None
        return ALIGN if self._in_use is not None else 1

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, view: memoryview, offset: int) -> int:
        fd = self._in_use
        if fd is not None and not offset % ALIGN and not len(view) % ALIGN and fileio.aligned_like(view, offset, ALIGN):
            return fileio.pread_into(fd, view, offset, self.path)
        return fileio.pread_into(self.fd, view, offset, self.path, self.request)

    def readv_into(self, views: Sequence[memoryview], offset: int) -> int:
        return fileio.preadv_all(self.fd, views, offset, self.path, self.request)

    def descriptor(self) -> int | None:
        return self.fd if self._in_use is None else None

    def resident_fraction(self, offset: int, length: int) -> float | None:
        return fileio.resident_fraction(self.fd, offset, length)

    def reader(self, resident: bool = False) -> Source:
        """A new open file description of the file for one thread (buffered reads only: an
        O_DIRECT read has no readahead), advised sequential, reading in calls of READ_REQUEST
        bytes: the readahead each call starts then runs on while the thread is busy (a whole
        chunk in one call waits for all of it). Bytes already ``resident`` in the page cache
        are read a whole chunk per call (each call gives the interpreter lock up and takes it
        back, behind the other readers). The source itself where the file cannot be reopened
        (no /proc)."""
        if self._in_use is not None:
            return self
        try:
            fd = fileio.reopen(self.fd, os.O_RDONLY)
        except OSError:
            return self
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        reader = FileSource(fd, self.path, owned=True, name=self.name)
        reader.request = None if resident else READ_REQUEST
        return reader

    def map(self, offset: int, length: int) -> Mapping:
        return Mapping(self.fd, offset, length, self.path)

    def check_length(self, offset: int, nbytes: int) -> None:
        """Fail before any device work where a regular file is too short for a read (a block
        device's length is not checked)."""
        fileio.check_length(self.fd, self.path, offset, nbytes)
