"""How the processes of a CheckpointManager agree that a step is complete.

Each rank writes its own file of the step; the step's DONE marker is published by rank 0 only
once every rank's file is durable. The agreement runs in each save's worker thread, after its
file is published (or failed), in step order:

- one process: nothing to agree on;
- a ``torch.distributed`` process group: over a gloo group of the manager's own, made when the
  manager is (a collective call), so that no collective runs on the training's groups from a
  background thread: every rank sends its outcome to all, rank 0 publishes DONE when all
  succeeded, then tells every rank what happened;
- several processes without a process group: through files in the step folder. Rank 0 waits for
  every rank's file, then publishes DONE; the other ranks wait for DONE. A rank whose save failed
  leaves a FAILED marker, which ends the others' wait at once. Nothing tells a file of this run
  from one that a crashed run left for the same step but the rank's own clean-up when its manager
  is made: every rank makes its manager before training starts, and the training's own
  collectives keep rank 0 from reaching a save before the others have cleaned up.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable

from . import _layout
from ._errors import CkptStreamError
from ._publish import atomic_file

POLL_S = 0.05


class IncompleteCheckpointError(CkptStreamError, RuntimeError):
    """A step of a CheckpointManager did not complete: another rank's save failed, or the ranks
    disagree on the step (each rank's own failure is raised as itself)."""


class Ranks:
    """One process: rank 0 of 1."""

    rank, world_size = 0, 1
    collective = False

    def __init__(self, directory: str, timeout: float) -> None:
        self.directory, self.timeout = directory, timeout

    def complete(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> None:
        """Called in the worker once this rank's file of ``step`` is durable (``error`` None) or
        failed; returns once the step is complete, or raises why it is not."""
        if error is not None:
            raise error
        publish()

    def close(self) -> None:
        pass


class GroupRanks(Ranks):
    """The ranks of the default ``torch.distributed`` process group."""

    collective = True

    def __init__(self, directory: str, timeout: float) -> None:
        import torch.distributed as dist

        super().__init__(directory, timeout)
        self._dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # collective: every rank makes its manager at the same point of its program
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        # nobody saves while the leftovers of an interrupted run are removed
        _layout.remove_own_leftovers(directory, self.rank, self.world_size)
        dist.barrier(group=self._group)
        if self.rank == 0:
            for folder in _layout.step_dirs(directory).values():
                if _layout.read_done(folder) is None:
                    _layout.remove_step(directory, folder)
        dist.barrier(group=self._group)

    def complete(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> None:
        dist = self._dist
        outcomes: list[tuple[int, str | None] | None] = [None] * self.world_size
        mine = (step, None if error is None else f"{type(error).__name__}: {error}")
        dist.all_gather_object(outcomes, mine, group=self._group)
        verdict: list[str | None] = [None]
        if self.rank == 0:
            problems = [f"rank {r}: {o[1]}" for r, o in enumerate(outcomes) if o is not None and o[1] is not None]
            steps = {o[0] for o in outcomes if o is not None}
            if len(steps) > 1:
                problems.append(f"the ranks saved different steps at once: {sorted(steps)} (every rank must save "
                                "the same steps, in the same order)")
            if not problems:
                try:
                    publish()
                except Exception as e:
                    problems.append(f"rank 0 could not publish the DONE marker: {type(e).__name__}: {e}")
            verdict[0] = "; ".join(problems) or None
        dist.broadcast_object_list(verdict, src=0, group=self._group)
        if error is not None:
            raise error
        if verdict[0] is not None:
            raise IncompleteCheckpointError(f"step {step} in {self.directory} is not complete: {verdict[0]}")

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # the default group went, and this one with it
                self._dist.destroy_process_group(group)


class FileRanks(Ranks):
    """Several processes without a process group: agreement through files (see the module)."""

    def __init__(self, directory: str, timeout: float, rank: int, world_size: int) -> None:
        super().__init__(directory, timeout)
        self.rank, self.world_size = rank, world_size
        _layout.remove_own_leftovers(directory, rank, world_size)  # before anyone waits for this rank

    def complete(self, step: int, error: BaseException | None, publish: Callable[[], None]) -> None:
        folder = _layout.step_dir(self.directory, step)
        if error is not None:
            try:
                with atomic_file(os.path.join(folder, _layout.failed_name(self.rank))) as file:
                    os.write(file.fd, f"{type(error).__name__}: {error}\n".encode())
            except OSError:
                pass  # the others then wait until their timeout
            raise error
        names = [_layout.file_name(r, self.world_size) for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        while True:
            failed = self._failures(folder)
            if failed:
                raise IncompleteCheckpointError(f"step {step} in {self.directory} is not complete: {failed}")
            if self.rank == 0 and all(os.path.exists(os.path.join(folder, n)) for n in names):
                publish()
                return
            if self.rank != 0 and os.path.exists(os.path.join(folder, _layout.DONE)):
                return
            if time.monotonic() > deadline:
                waiting = "every rank's file" if self.rank == 0 else "rank 0's DONE marker"
                raise TimeoutError(f"step {step} in {self.directory}: waited {self.timeout:g} s for {waiting}; "
                                   "is every rank running and saving the same steps?")
            time.sleep(POLL_S)

    def _failures(self, folder: str) -> str:
        found = []
        for r in range(self.world_size):
            try:
                with open(os.path.join(folder, _layout.failed_name(r)), encoding="utf-8") as f:
                    found.append(f"rank {r}: {f.read().strip()}")
            except FileNotFoundError:
                continue
        return "; ".join(found)
