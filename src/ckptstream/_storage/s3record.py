"""The writer lock of an object store: a record of the newest writer, not a lock (S3 has none
that its holder's death releases; a lock object that a killed writer left would refuse every
later writer until someone removed it by hand). Taking it replaces the record there; the writer
it named learns so at its next ``check``."""

from __future__ import annotations

import contextlib
import errno
import os

from .base import Lock, LockHeldError, Storage

RECORD_BYTES = 4096  # of a writer record read back (a manager's is about 150 bytes)


class WriterRecord(Lock):
    """``S3Storage.lock``'s: the object ``path`` holds the newest writer's ``holder`` bytes (one
    PUT at the start, one GET per ``check``). A record found gone (its writer closed meanwhile)
    is written again; closing removes it while it is still this writer's."""

    def __init__(self, storage: Storage, path: str, holder: bytes) -> None:
        self._storage, self.path, self._holder = storage, path, holder
        self._pid: int | None = os.getpid()
        storage.write_small(path, holder)

    def _found(self) -> bytes | None:
        try:
            return self._storage.read_small(self.path, RECORD_BYTES)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.EFBIG:  # not a record of ours: someone else's, too long to read
                return b""
            raise

    def check(self) -> None:
        if self._pid != os.getpid():
            return
        found = self._found()
        if found is None:
            self._storage.write_small(self.path, self._holder)
        elif found != self._holder:
            raise LockHeldError(self.path, found)

    def close(self) -> None:
        pid, self._pid = self._pid, None
        if pid == os.getpid():  # in a forked child: the parent's record
            with contextlib.suppress(OSError):  # a record left behind is taken over by the next writer
                if self._found() == self._holder:
                    self._storage.remove(self.path, missing_ok=True)
