"""One writing CheckpointManager per rank of a directory: the storage's writer lock named
``DIR/.lock-rank-NNNNN``, held for the writing manager's life (``Storage.lock``: on local files
a lock file held with ``flock``, which the kernel releases when the process dies, and which a
forked child does not hold). The holder's host, pid and start time go with the lock, for the
message of the writer that is refused.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket

from .._errors import DirectoryLockedError
from .._storage import Lock, LockHeldError, storage_for


def lock_name(rank: int) -> str:
    return f".lock-rank-{rank:05d}"


class WriterLock:
    """The lock of ``rank`` in ``directory``, taken at construction.

    Raises:
        DirectoryLockedError: another manager (of this process or another) holds it.
        OSError: the lock cannot be made (a directory that cannot be written).
    """

    def __init__(self, directory: str, rank: int) -> None:
        storage = storage_for(directory)
        self.directory, self.rank = directory, rank
        self.path = storage.join(directory, lock_name(rank))
        # the id tells two managers of one process apart (on a store where the lock is a record)
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "since": datetime.datetime.now().isoformat(timespec="seconds"),
                         "id": secrets.token_hex(8)}).encode()
        try:
            self._lock: Lock | None = storage.lock(self.path, me)
        except LockHeldError as e:
            holder = _holder(e.holder)
            raise DirectoryLockedError(
                f"{directory} is written by another CheckpointManager as rank {rank}: {_who(holder)} holds "
                f"{self.path}. {ONE_WRITER}", directory, rank, holder) from None

    def check(self) -> None:
        """Raise DirectoryLockedError where another manager has taken over the rank since (an
        object store, whose lock is the newest writer's record): nothing of this manager may be
        counted from then on.

        Raises:
            DirectoryLockedError: naming the other manager.
            OSError: the record cannot be read.
        """
        if self._lock is None:
            return
        try:
            self._lock.check()
        except LockHeldError as e:
            holder = _holder(e.holder)
            raise DirectoryLockedError(
                f"{self.directory} is written by another CheckpointManager as rank {self.rank} since this one "
                f"started: {_who(holder)} replaced this manager's record {self.path}. This manager's saves from "
                f"then on are not counted (their objects may hold the other's state, or it theirs); this one stops "
                f"writing. {ONE_WRITER}", self.directory, self.rank, holder) from None

    def close(self) -> None:
        """Release the lock (in a forked child: the parent's lock stays held); safe to call twice."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()


ONE_WRITER = ("One manager writes as a rank of a directory at a time: close the other (or let it exit), or save "
              "into another directory; reading (latest_step, steps, load, path) needs no lock")


def _who(holder: dict[str, object]) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    return f"process {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('since')})"


def _holder(data: bytes) -> dict[str, object]:
    try:
        # the holder writes one flat object: anything nested is not read (json recurses)
        holder = json.loads(data) if data.count(b"{") + data.count(b"[") == 1 else None
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}
