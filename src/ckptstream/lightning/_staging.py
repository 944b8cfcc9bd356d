"""Where a "lazy" save must be staged before training changes the state it streams from.

Lightning saves a checkpoint in ``on_train_batch_end`` or ``on_validation_end``, after the
optimizer step of that batch. What changes the saved tensors next:

- the next optimizer step's update. With automatic optimization Lightning runs the forward and
  backward pass inside ``optimizer.step(closure)`` (the closure), so a hook before the step
  would wait before the forward pass; the guard wraps the closure instead and waits once it has
  run: the forward and backward pass overlap the save, the update does not;
- a forward pass in training mode that updates buffers saved in the checkpoint (BatchNorm's
  running statistics): the guard waits before the forward of a module in training mode that holds
  such a buffer.

Both are process-wide torch hooks (``register_optimizer_step_pre_hook``,
``register_module_forward_pre_hook``), so they also hold for a loop without Lightning. The
forward hook is registered only while a save is not staged (a registered global forward hook
costs every module call); the optimizer hook stays until ``close``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._checkpoint.save_async import SaveHandle

__all__ = ["StagingGuard"]

StorageKey = tuple[torch.device, int]


def storage_key(t: torch.Tensor) -> StorageKey:
    return t.device, t.untyped_storage().data_ptr()


class StagingGuard:
    """Waits for the unstaged "lazy" saves of one StreamCheckpointIO where the state changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []
        self._storages: set[StorageKey] = set()  # the storages the pending saves may still read
        self._forward: RemovableHandle | None = None
        self._optimizer: RemovableHandle | None = None

    def arm(self, handle: SaveHandle, tensors: Iterable[torch.Tensor]) -> None:
        """Guard the state of ``handle`` (a save in "lazy" mode) until it is staged."""
        with self._lock:
            self._pending.append(handle)
            self._storages.update(storage_key(t) for t in tensors if t.numel())
            if self._forward is None:
                self._forward = register_module_forward_pre_hook(self._before_forward)
            if self._optimizer is None:
                self._optimizer = register_optimizer_step_pre_hook(self._before_step)

    def armed(self) -> bool:
        return bool(self._pending)

    def wait(self) -> None:
        """Wait until every pending save is staged (a failed save counts as staged: its error is
        raised where its result is collected)."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._storages = set()
            forward, self._forward = self._forward, None
        for handle in pending:
            handle.wait_staged()
        if forward is not None:  # safe inside the forward hook: torch iterates over a copy
            forward.remove()

    def close(self) -> None:
        """Wait, and remove the hooks."""
        self.wait()
        with self._lock:
            optimizer, self._optimizer = self._optimizer, None
        if optimizer is not None:  # not from inside an optimizer hook: torch iterates over the live dict
            optimizer.remove()

    # --- the hooks ------------------------------------------------------------------------------

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._pending or not module.training:
            return
        storages = self._storages
        if any(b is not None and b.numel() and storage_key(b) in storages for b in module.buffers(recurse=False)):
            self.wait()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._pending:
            return None
        # args[0] is the optimizer itself; the closure is passed by keyword (Lightning) or first
        closure = kwargs.get("closure")
        if callable(closure):
            return args, {**kwargs, "closure": self._after(closure)}
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._after(args[1]), *args[2:]), kwargs
        self.wait()
        return None

    def _after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def closure_then_wait() -> Any:
            loss = closure()
            self.wait()
            return loss

        return closure_then_wait
