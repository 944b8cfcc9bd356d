"""One writing CheckpointManager per rank of a directory: a lock file per rank, held with
``flock`` for the writing manager's life.

The kernel releases the lock when the process dies (a SIGKILL included), so a crashed writer
never blocks the next. The holder writes its host and pid into the file, for the message of
the process that is refused. A forked child does not hold its parent's lock: its inherited
descriptor is closed at the fork (a lock stays held while any descriptor of it is open, and a
DataLoader worker may outlive the manager of its parent).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import weakref

from ._errors import CkptStreamError

HOLDER_BYTES = 4096


class DirectoryLockedError(CkptStreamError, RuntimeError):
    """Another CheckpointManager writes this directory as the same rank (``holder`` says which
    process: host and pid); read-only use (``latest_step``, ``steps``, ``load``, ``path``)
    needs no lock."""

    def __init__(self, message: str, directory: str, rank: int, holder: dict[str, object]) -> None:
        super().__init__(message)
        self.directory, self.rank, self.holder = directory, rank, holder


def lock_name(rank: int) -> str:
    return f".lock-rank-{rank:05d}"


_held: weakref.WeakSet[WriterLock] = weakref.WeakSet()


class WriterLock:
    """The lock of ``rank`` in ``directory``, taken at construction.

    Raises:
        DirectoryLockedError: another manager (of this process or another) holds it.
        OSError: the lock file cannot be made (a directory that cannot be written).
    """

    def __init__(self, directory: str, rank: int) -> None:
        self.path = os.path.join(directory, lock_name(rank))
        fd = _open(self.path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                who = (f"process {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('since')})"
                       if holder else "another process (it has not written its name yet)")
                raise DirectoryLockedError(
                    f"{directory} is written by another CheckpointManager as rank {rank}: {who} holds "
                    f"{self.path}. One manager writes as a rank of a directory at a time: close the other (or let "
                    "it exit), or save into another directory; reading (latest_step, steps, load, path) needs no "
                    "lock", directory, rank, holder) from None
            me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        _held.add(self)

    def close(self) -> None:
        """Close the lock's descriptor, which releases the lock once no other descriptor of it
        is open (never an explicit unlock: in a forked child that would release the parent's);
        safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            _held.discard(self)
            os.close(fd)


def _open(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (opening the manager's lock file; a link there is refused)",
                      path) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "is not a regular file: the manager's lock file is; remove what is there", path)
    return fd


def _holder(fd: int) -> dict[str, object]:
    try:
        data = os.pread(fd, HOLDER_BYTES, 0)
        # the holder writes one flat object: anything nested is not read (json recurses)
        holder = json.loads(data) if data.count(b"{") + data.count(b"[") == 1 else None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
