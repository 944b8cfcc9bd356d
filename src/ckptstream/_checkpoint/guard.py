"""Where training must not change a saved tensor before a background save has read it.

What changes a saved tensor while training goes on after a save's call:

- the optimizer's update. With a closure (Lightning runs the forward and backward pass inside
  ``optimizer.step(closure)``), a hook before the step would order the forward pass too: the
  guard orders once the closure has run, so the forward and backward pass overlap the save and
  the update does not;
- a forward pass in training mode of a module holding a saved buffer (BatchNorm's running
  statistics): the guard orders before that module's forward.

Both are process-wide torch hooks (``register_optimizer_step_pre_hook``,
``register_module_forward_pre_hook``), so they hold for any loop. What ordering means is the
hold's (``Hold``): a "host" save's copies (``HostCopies``) make each device's current stream wait
on the copies' event, so the update is queued at once and the host never waits; a "lazy" save
read from the live tensors (the Lightning plug-in's) waits on the host until it is staged.

A registered global forward hook costs every module call, so it is registered only while a hold
is pending and removed by the first hook call that finds none; the optimizer hook (one call per
step) stays until ``close``. Hooks are added and removed only in the thread that saves and
trains: a save's worker only marks its hold done.

What no hook sees stays the caller's job: an in-place change of a saved tensor outside an
optimizer's step and a module's forward (a hand-written ``p.data.add_()``, an update replayed
from a CUDA graph, an optimizer that is not a ``torch.optim.Optimizer``) must come after
``wait_staged()``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["GUARD", "Guard", "Hold", "HostCopies", "StorageKey", "storage_key", "storage_keys"]

StorageKey = tuple[torch.device, int]


def storage_key(t: torch.Tensor) -> StorageKey:
    return t.device, t.untyped_storage().data_ptr()


def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset[StorageKey]:
    return frozenset(storage_key(t) for t in tensors if t.numel())


class Hold(Protocol):
    """One save's claim on the tensors it still reads."""

    storages: frozenset[StorageKey]

    def order(self) -> None:
        """Make a change of the tensors from here on (in this thread) come after the save's read."""

    def done(self) -> bool:
        """Whether the save no longer reads the tensors (cheap: called from hooks)."""


class HostCopies:
    """The device-to-host copies of one "host" save, queued on side streams: one event per
    device, recorded after its copies."""

    def __init__(self, events: dict[torch.device, torch.cuda.Event], storages: frozenset[StorageKey]) -> None:
        self.events, self.storages = events, storages
        self._finished = False

    def order(self) -> None:
        """Each device's current stream waits on its copies (queued; the host does not wait)."""
        if self._finished:
            return
        for device, event in self.events.items():
            stream = torch.cuda.current_stream(device)
            if torch.cuda.is_current_stream_capturing():
                # a CUDA graph being captured runs nothing now and may not wait on an event
                # recorded outside it: its replays are the caller's to order (wait_staged())
                continue
            stream.wait_event(event)

    def synchronize(self) -> None:
        """Wait on the host until the copies are done (the save's worker, before it reads them)."""
        for event in self.events.values():
            event.synchronize()
        self._finished = True

    def finish(self) -> None:
        """Nothing reads the tensors any more (the copies are done, or the save ended)."""
        self._finished = True

    def done(self) -> bool:
        return self._finished

    def query(self) -> bool:
        """Whether the copies are done, asking the devices."""
        if not self._finished and all(event.query() for event in self.events.values()):
            self._finished = True
        return self._finished


class Guard:
    """Orders the changes of saved tensors after the pending holds (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: list[Hold] = []
        self._forward: RemovableHandle | None = None
        self._optimizer: RemovableHandle | None = None

    def arm(self, hold: Hold) -> None:
        """Guard the tensors of ``hold`` until it is done."""
        with self._lock:
            self._holds.append(hold)
            if self._forward is None:
                self._forward = register_module_forward_pre_hook(self._before_forward)
            if self._optimizer is None:
                self._optimizer = register_optimizer_step_pre_hook(self._before_step)

    def pending(self) -> list[Hold]:
        """The holds not done yet (a "host" save's copies are asked whether they are)."""
        with self._lock:
            self._holds = [h for h in self._holds if not (h.done() or (isinstance(h, HostCopies) and h.query()))]
            return list(self._holds)

    def armed(self) -> bool:
        return bool(self.pending())

    def order(self, holds: list[Hold] | None = None) -> None:
        """Order what this thread does next after every pending hold (``holds``: those only),
        and remove the forward hook once none is pending."""
        for hold in self.pending() if holds is None else holds:
            hold.order()
        if not self.pending():
            self._remove_forward()

    def close(self) -> None:
        """Order, stop guarding, and remove the hooks (never from inside an optimizer hook: torch
        iterates over the live dict of those)."""
        self.order()
        with self._lock:
            self._holds = []
            forward, self._forward = self._forward, None
            optimizer, self._optimizer = self._optimizer, None
        for hook in (forward, optimizer):
            if hook is not None:
                hook.remove()

    def forget(self) -> None:
        """Drop every hold (a forked child owns none of its parent's saves)."""
        with self._lock:
            self._holds = []

    def _remove_forward(self) -> None:
        with self._lock:
            self._holds = [h for h in self._holds if not h.done()]
            if self._holds:
                return
            forward, self._forward = self._forward, None
        if forward is not None:  # safe inside the forward hook: torch iterates over a copy
            forward.remove()

    # --- the hooks ------------------------------------------------------------------------------

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        holds = [h for h in self._holds if not h.done()]
        if not holds:
            self._remove_forward()
            return
        if not module.training:
            return
        keys = {storage_key(b) for b in module.buffers(recurse=False) if b is not None and b.numel()}
        if keys:
            self.order([h for h in holds if not keys.isdisjoint(h.storages)])

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._holds or not self.pending():
            return None
        # args[0] is the optimizer itself; the closure is passed by keyword (Lightning) or first
        closure = kwargs.get("closure")
        if callable(closure):
            return args, {**kwargs, "closure": self._after(closure)}
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._after(args[1]), *args[2:]), kwargs
        self.order()
        return None

    def _after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def closure_then_order() -> Any:
            loss = closure()
            self.order()
            return loss

        return closure_then_order


GUARD = Guard()  # the process's guard of "host" saves' copies
os.register_at_fork(after_in_child=GUARD.forget)
