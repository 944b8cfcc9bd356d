"""Writer locks on the local file system (``LocalStorage.lock``): a lock file held with
``flock`` for the lock's life.

The kernel releases the lock when the process dies (a SIGKILL included), so a crashed writer
never blocks the next. The holder's bytes are written into the file, for the message of the
writer that is refused. A forked child does not hold its parent's lock: its inherited
descriptor is closed at the fork (a lock stays held while any descriptor of it is open, and a
DataLoader worker may outlive the writer of its parent); never an explicit unlock, which in a
forked child would release the parent's.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import weakref

from .base import Lock, LockHeldError

HOLDER_BYTES = 4096  # of the holder's bytes read back for the refused writer

_held: weakref.WeakSet[FileLock] = weakref.WeakSet()


class FileLock(Lock):
    """The lock file ``path`` (created where missing), locked at construction.

    Raises:
        LockHeldError: another open file description holds it (of this process or another).
        OSError: the file cannot be made or opened (a link or anything but a regular file there).
    """

    def __init__(self, path: str, holder: bytes) -> None:
        self.path = path
        fd = _open(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeldError(path, _holder(fd)) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        _held.add(self)

    def close(self) -> None:
        """Close the lock's descriptor, which releases the lock once no other descriptor of it
        is open."""
        fd, self._fd = self._fd, None
        if fd is not None:
            _held.discard(self)
            os.close(fd)


def _open(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (opening the lock file; a link there is refused)", path) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "is not a regular file: a lock file is; remove what is there", path)
    return fd


def _holder(fd: int) -> bytes:
    try:
        return os.pread(fd, HOLDER_BYTES, 0)
    except OSError:
        return b""


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
