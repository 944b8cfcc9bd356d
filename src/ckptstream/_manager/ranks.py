"""How the processes of a CheckpointManager agree that a step is complete.

Each rank writes its own file of the step; the step's DONE marker is published by rank 0 only
once every rank's file is durable. The agreement runs in each save's worker thread, after its
file is published (or failed), in step order:

- one process: nothing to agree on;
- a ``torch.distributed`` process group: over a gloo group of the manager's own, made when the
  manager is (a collective call), so that no collective runs on the training's groups from a
  background thread. Every rank sends its outcome to all (a fixed-size byte tensor: the step,
  whether it failed and why), rank 0 publishes DONE when all succeeded, then sends every rank
  whether that worked. Plain tensor collectives: nothing is pickled and numpy is not needed;
- several processes without a process group: through files in the step folder. A rank whose
  file is durable, and which has seen the outcome of each of its earlier steps, says so with a
  READY marker; rank 0 publishes DONE once every rank is ready, and the other ranks wait for
  DONE. So rank 0 completes (and then prunes the steps before) a step only once every rank has
  seen the outcome of every earlier step: no rank ever waits for a step that is gone, whatever
  ``keep`` and ``max_in_flight``. A rank whose save failed (rank 0 also when it could not
  publish, or gave up waiting) leaves a FAILED marker, which ends the others' wait at once.
  Nothing tells a marker or file of this run from one that a crashed run left for the same step
  but the rank's own clean-up when its manager is made: every rank makes its manager before
  training starts, and the training's own collectives keep rank 0 from reaching a save before
  the others have cleaned up.
"""

from __future__ import annotations

import contextlib
import datetime
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import CheckpointTimeoutError, CkptStreamError, IncompleteCheckpointError
from .._storage import Entry, storage_for
from . import directory as _directory
from .lock import WriterLock

POLL_S = 0.05
_HEAD = struct.Struct("<qBxxxI")  # step, failed, length of the text
TEXT_BYTES = 1000  # of a rank's failure, sent to every rank (longer ones are cut)
_RECORD = _HEAD.size + TEXT_BYTES




class Ranks:
    """One process: rank 0 of 1. Its lock is taken at the first write (``lock()``): a manager
    that only reads takes none."""

    rank, world_size = 0, 1
    collective = False

    def __init__(self, directory: str, timeout: float) -> None:
        self.directory, self.timeout = directory, timeout
        self._lock: WriterLock | None = None

    def lock(self) -> None:
        """Hold this rank's writer lock of the directory from now on (see ``lock``)."""
        if self._lock is None:
            self._lock = WriterLock(self.directory, self.rank)

    def check_lock(self) -> None:
        """Raise DirectoryLockedError where another manager has taken this rank's lock over
        since it was taken (``WriterLock.check``)."""
        if self._lock is not None:
            self._lock.check()

    def complete(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> None:
        """Called in the worker once this rank's file of ``step`` is durable (``error`` None) or
        failed; returns once the step is complete, or raises why it is not."""
        if error is not None:
            raise error
        publish()

    def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()

    def forget(self) -> None:
        """In a forked child: let go of what the parent owns without touching it."""
        self._lock = None  # its descriptor was closed at the fork


class GroupRanks(Ranks):
    """The ranks of the default ``torch.distributed`` process group."""

    collective = True

    def __init__(self, directory: str, timeout: float) -> None:
        import torch
        import torch.distributed as dist

        super().__init__(directory, timeout)
        self._dist, self._torch = dist, torch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # collective: every rank makes its manager at the same point of its program
        self._group: Any = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        try:
            self._lock_together()
            # nobody saves while the leftovers of an interrupted run are removed
            _directory.remove_own_leftovers(directory, self.rank, self.world_size)
            dist.barrier(group=self._group)
            if self.rank == 0:
                for check in _directory.check_steps(directory):
                    if not check.complete:
                        _directory.remove_step(directory, check.folder)
            dist.barrier(group=self._group)
        except BaseException:
            self.close()
            raise

    def _lock_together(self) -> None:
        """Every rank takes its lock; when one cannot, every rank raises (none is left waiting
        in a collective for it)."""
        try:
            self.lock()
            error: BaseException | None = None
        except (OSError, CkptStreamError) as e:
            error = e
        outcomes = self._gather(-1, error)
        if error is not None:
            raise error
        refused = [f"rank {r}: {text}" for r, (_, failed, text) in enumerate(outcomes) if failed]
        if refused:
            raise IncompleteCheckpointError(f"the manager of {self.directory} cannot write: {'; '.join(refused)}")

    def _record(self, step: int, error: BaseException | None) -> Any:
        text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:TEXT_BYTES]
        buf = bytearray(_RECORD)
        _HEAD.pack_into(buf, 0, step, error is not None, len(text))
        buf[_HEAD.size : _HEAD.size + len(text)] = text
        return self._torch.frombuffer(buf, dtype=self._torch.uint8).clone()

    @staticmethod
    def _read(record: Any) -> tuple[int, bool, str]:
        step, failed, length = _HEAD.unpack(bytes(record[: _HEAD.size].tolist()))
        text = bytes(record[_HEAD.size : _HEAD.size + length].tolist()).decode("utf-8", "replace") if failed else ""
        return step, bool(failed), text

    def _gather(self, step: int, error: BaseException | None) -> list[tuple[int, bool, str]]:
        records = [self._torch.empty(_RECORD, dtype=self._torch.uint8) for _ in range(self.world_size)]
        self._collective(step, "sending its outcome to the other ranks",
                         lambda: self._dist.all_gather(records, self._record(step, error), group=self._group))
        return [self._read(r) for r in records]

    def _collective(self, step: int, what: str, call: Callable[[], object]) -> None:
        """A collective on the manager's group; its errors say which step and what happened."""
        try:
            call()
        except RuntimeError as e:  # gloo raises RuntimeError (DistBackendError) for timeouts and lost peers
            where = f"step {step} in {self.directory}" if step >= 0 else f"the manager of {self.directory}"
            if "timed out" in str(e).lower():
                raise CheckpointTimeoutError(
                    f"{where}: rank {self.rank} waited {self.timeout:g} s (the manager's timeout) {what}; is every "
                    "rank running and saving the same steps? The manager's group is out of step now: make a new "
                    f"manager ({e})") from e
            raise IncompleteCheckpointError(f"{where}: rank {self.rank} failed {what}: {e}") from e

    def complete(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> None:
        try:
            problems = self._agree(step, error, publish)
        except CkptStreamError:
            if error is not None:  # this rank's own failure says more
                raise error from None
            raise
        if error is not None:
            raise error
        if problems:
            raise IncompleteCheckpointError(f"step {step} in {self.directory} is not complete: {'; '.join(problems)}")

    def _agree(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> list[str]:
        """Every rank's outcome to all, rank 0 publishes, its outcome to all: what went wrong."""
        outcomes = self._gather(step, error)
        problems = [f"rank {r}: {text}" for r, (_, failed, text) in enumerate(outcomes) if failed]
        steps = sorted({s for s, _, _ in outcomes})
        if len(steps) > 1:
            problems.append(f"the ranks saved different steps at once: {steps} (every rank must save the same "
                            "steps, in the same order)")
        published: BaseException | None = None
        if self.rank == 0 and not problems:
            try:
                publish()
            except Exception as e:
                published = e
        verdict = self._record(step, published)
        self._collective(step, "waiting for rank 0 to publish the DONE marker",
                         lambda: self._dist.broadcast(verdict, src=0, group=self._group))
        _, failed, text = self._read(verdict)
        if failed:
            problems.append(f"rank 0 could not publish the DONE marker: {text}")
        return problems

    def close(self) -> None:
        group, self._group = self._group, None
        try:
            if group is not None:
                with contextlib.suppress(RuntimeError, ValueError):  # the default group went, and this one with it
                    self._dist.destroy_process_group(group)
        finally:
            super().close()

    def forget(self) -> None:
        self._group = None  # the parent's: destroying it here would shut its connections down
        super().forget()


class FileRanks(Ranks):
    """Several processes without a process group: agreement through files (see the module)."""

    def __init__(self, directory: str, timeout: float, rank: int, world_size: int) -> None:
        super().__init__(directory, timeout)
        self.rank, self.world_size = rank, world_size
        self.lock()  # the clean-up below writes: this rank's manager writes from now on
        _directory.remove_own_leftovers(directory, rank, world_size)  # before anyone waits for this rank

    def complete(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> None:
        folder = _directory.step_dir(self.directory, step)
        if error is not None:
            self._mark_failed(folder, error)
            raise error
        if self.rank != 0:  # this rank's file is durable, and it has seen each earlier step's outcome
            _directory.write_marker(folder, _directory.ready_name(self.rank), b"")
        deadline = time.monotonic() + self.timeout
        while not self._poll(step, folder, publish):
            if time.monotonic() > deadline:
                self._time_out(step, folder)
            time.sleep(POLL_S)

    def _poll(self, step: int, folder: str, publish: Callable[[], None]) -> bool:
        """One look at the step folder: True once the step is complete (rank 0: published), False
        while waiting; raises when a rank failed."""
        entries = _directory.listing(folder)
        failed = self._failures(folder, entries)
        if failed:
            raise IncompleteCheckpointError(f"step {step} in {self.directory} is not complete: {failed}")
        if self.rank != 0:
            return _directory.DONE in entries and _directory.check_step(folder).complete
        if self._waiting_for(entries):
            return False
        storage = storage_for(folder)
        for r in range(1, self.world_size):  # every rank is ready: nobody reads these again
            with contextlib.suppress(OSError):
                storage.remove(storage.join(folder, _directory.ready_name(r)), missing_ok=True)
        try:
            publish()
        except BaseException as e:
            self._mark_failed(folder, e)
            raise
        return True

    def _waiting_for(self, entries: Mapping[str, Entry]) -> list[int]:
        """The ranks whose file or READY marker is not among ``entries`` (of the step folder)."""
        return [r for r in range(self.world_size)
                if _directory.file_name(r, self.world_size) not in entries
                or (r != 0 and _directory.ready_name(r) not in entries)]

    def _time_out(self, step: int, folder: str) -> None:
        if self.rank == 0:
            waited = f"rank(s) {self._waiting_for(_directory.listing(folder))} to save it"
        else:
            waited = "rank 0's DONE marker"
        error = CheckpointTimeoutError(f"step {step} in {self.directory}: rank {self.rank} waited {self.timeout:g} s "
                                       f"(the manager's timeout) for {waited}; is every rank running and saving the "
                                       "same steps?")
        if self.rank == 0:  # the ranks that did save stop waiting now
            self._mark_failed(folder, error)
        raise error

    def _mark_failed(self, folder: str, error: BaseException) -> None:
        with contextlib.suppress(OSError):  # the others then wait until their timeout
            text = f"{type(error).__name__}: {error}\n".encode()
            _directory.write_marker(folder, _directory.failed_name(self.rank), text)

    def _failures(self, folder: str, entries: Mapping[str, Entry]) -> str:
        storage = storage_for(folder)
        found = [f"rank {r}: {_directory.failure_text(storage, folder, entries[_directory.failed_name(r)])}"
                 for r in range(self.world_size) if _directory.failed_name(r) in entries]
        return "; ".join(found)
