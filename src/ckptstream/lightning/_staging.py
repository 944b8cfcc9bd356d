"""Where a "lazy" save must be staged before training changes the state it streams from.

Lightning saves a checkpoint in ``on_train_batch_end`` or ``on_validation_end``, after the
optimizer step of that batch. What changes the saved tensors next is what the core guard
(``ckptstream._checkpoint.guard``) watches, with the same hooks that order a "host" save's copies: the next
optimizer step's update (after its closure, which runs the forward and backward pass under
Lightning's automatic optimization) and a training-mode forward of a module holding a saved
buffer (BatchNorm's running statistics). For a "lazy" save the guard waits on the host until
the save has copied the state out. Each plug-in has its own guard: its ``close`` (at teardown)
removes the hooks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._checkpoint.guard import Guard, StorageKey, storage_key, storage_keys
from .._checkpoint.save_async import SaveHandle

__all__ = ["StagingGuard", "storage_key"]


class LiveRead:
    """A "lazy" save still reading the live tensors."""

    def __init__(self, handle: SaveHandle, storages: frozenset[StorageKey]) -> None:
        self.handle, self.storages = handle, storages

    def order(self) -> None:
        self.handle.wait_staged()  # a failed save counts as staged: its error is raised by result()

    def done(self) -> bool:
        return self.handle.staged()


class StagingGuard:
    """Waits for the unstaged "lazy" saves of one StreamCheckpointIO where the state changes."""

    def __init__(self) -> None:
        self._guard = Guard()

    def arm(self, handle: SaveHandle, tensors: Iterable[torch.Tensor]) -> None:
        """Guard the state of ``handle`` (a save in "lazy" mode) until it is staged."""
        self._guard.arm(LiveRead(handle, storage_keys(tensors)))

    def armed(self) -> bool:
        return self._guard.armed()

    def wait(self) -> None:
        """Wait until every pending save is staged (a failed save counts as staged: its error is
        raised where its result is collected)."""
        self._guard.order()

    def close(self) -> None:
        """Wait, and remove the hooks."""
        self._guard.close()
