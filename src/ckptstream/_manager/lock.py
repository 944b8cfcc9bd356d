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
        self.path = storage.join(directory, lock_name(rank))
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode()
        try:
            self._lock: Lock | None = storage.lock(self.path, me)
        except LockHeldError as e:
            holder = _holder(e.holder)
            who = (f"process {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('since')})"
                   if holder else "another process (it has not written its name yet)")
            raise DirectoryLockedError(
                f"{directory} is written by another CheckpointManager as rank {rank}: {who} holds "
                f"{self.path}. One manager writes as a rank of a directory at a time: close the other (or let "
                "it exit), or save into another directory; reading (latest_step, steps, load, path) needs no "
                "lock", directory, rank, holder) from None

    def close(self) -> None:
        """Release the lock (in a forked child: the parent's lock stays held); safe to call twice."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()


def _holder(data: bytes) -> dict[str, object]:
    try:
        # the holder writes one flat object: anything nested is not read (json recurses)
        holder = json.loads(data) if data.count(b"{") + data.count(b"[") == 1 else None
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}
