"""What a background save reads, captured in the caller's thread at the call.

Each mode turns the state's tensors (in file order) into the tensors the worker streams, and
says when the caller may change the state again:

- CPU tensors are copied at the call (by value), so that a CPU ``step`` counter or RNG state
  changed right after the call is never written beside device tensors of another step; in
  "lazy" mode only those of up to BY_VALUE_BYTES (a large CPU tensor streams like a device
  tensor, under the same ``wait_staged`` rule).
- "device": the device-to-device copies are queued on each device's current stream: they run
  after the work queued before the call and before any work queued after it, so the next
  optimizer step cannot change a tensor before its copy has read it. The snapshot belongs to the
  save alone until the engine has synchronized its copies out of it.
- "host": the device-to-host copies run on a side stream of each device, which first waits on
  an event recorded on the current stream at the call (the copies see every write queued
  before it); the current stream does not wait behind them, so the forward and backward pass
  that follow (which only read the state) run beside them. What orders a change after them is
  the process's guard (``guard``: before an optimizer's update, before a training-mode forward
  of a module holding a saved buffer), ``wait_staged()``, or the worker's wait for the copies;
  the live tensors are kept referenced until then, so their memory is not reused under the
  copies.
- The engine's ordering point (``mark``) is taken here, after those copies: the worker's engine,
  made later in another thread, orders its own copies after it.
- "host" with ``kept_memory`` (``save_async``): the copies go into one block of the process's
  snapshot memory (``snapshot``), lent until ``Captured.finish()`` and then kept for the next
  save of the same size, instead of new pinned tensors each time.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from .._engine import Mark, copyable, empty_tensor, mark
from .guard import GUARD, HostCopies, storage_keys
from .snapshot import MEMORY, Block, layout


class AsyncMode(str, enum.Enum):
    """What a background save reads (``save_async``, ``CheckpointManager``, ``ckptstream.dcp``'s
    ``dcp.async_save``): "device" (a snapshot in spare device memory), "lazy" (the live tensors,
    until ``wait_staged()``) or "host" (a snapshot in host memory). A plain string works too."""

    DEVICE = "device"
    LAZY = "lazy"
    HOST = "host"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, name: str = "mode") -> AsyncMode:
        """``value`` as a mode; ValueError naming ``name`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}") from None


MODES = tuple(m.value for m in AsyncMode)
BY_VALUE_BYTES = 1 << 20  # "lazy": CPU tensors up to this size are still captured by value
CPU = torch.device("cpu")



@dataclasses.dataclass
class Captured:
    """The tensors a worker streams and when the state may change."""

    tensors: list[torch.Tensor]
    mode: AsyncMode  # the mode in effect
    after: Mark | None = None  # where the engine's device copies start (device tensors among ``tensors``)
    ready: list[Any] = dataclasses.field(default_factory=list)  # events to wait for before streaming
    staged: bool = True  # the caller need not wait on the host before changing the state
    fallback: str = ""  # why "device" became "lazy"
    copies: HostCopies | None = None  # "host": the side streams' copies, which order the caller's streams
    keep: list[torch.Tensor] = dataclasses.field(default_factory=list)  # read by the copies until they are done
    block: Block | None = None  # "host" with kept_memory: the snapshot memory ``tensors`` are views of

    def finish(self) -> None:
        """The save has ended: nothing reads the state nor the snapshot any more (the guard lets
        go; the snapshot memory is kept for the next save). Safe to call twice."""
        if self.copies is not None:
            self.copies.finish()
        block, self.block = self.block, None
        if block is not None:
            MEMORY.give_back(block)

    def copied(self) -> None:
        """Wait for the copies into host memory (``ready``); the live tensors are no longer read."""
        for event in self.ready:
            event.synchronize()
        if self.copies is not None:
            self.copies.finish()
        self.keep.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy(t: torch.Tensor, device: torch.device, pin: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous copy of ``t`` on ``device`` (a pinned host tensor with ``pin``; into ``out``,
    host memory pinned with ``pin``, where given), queued on the current stream of ``t``'s device
    when either side is a GPU."""
    if out is None and pin and t.numel():
        out = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
    elif out is None:
        out = empty_tensor(tuple(t.shape), t.dtype, device)
    if t.numel():
        copyable(out).copy_(copyable(t), non_blocking=pin or out.is_cuda)
    return out


def _device_snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of the device tensors in new device memory (None when it runs out), of the CPU
    tensors in host memory."""
    out: list[torch.Tensor] = []
    try:
        for t in tensors:
            out.append(_copy(t, t.device))
    except torch.cuda.OutOfMemoryError:
        out.clear()  # nothing queued reads these any more once their copies are dropped
        return None
    return out


def _short_memory_message(tensors: list[torch.Tensor], fell_back: bool = True) -> str:
    need: dict[torch.device, int] = {}
    for t in tensors:
        if t.is_cuda:
            need[t.device] = need.get(t.device, 0) + _nbytes(t)
    parts = []
    for device, nbytes in sorted(need.items(), key=lambda kv: str(kv[0])):
        try:
            free = torch.cuda.mem_get_info(device)[0]
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached by torch
            parts.append(f"{nbytes / 2**30:.2f} GiB on {device}, {free / 2**30:.2f} GiB free")
        except RuntimeError:  # the message must not fail where the snapshot did
            parts.append(f"{nbytes / 2**30:.2f} GiB on {device}")
    what = ("the save streamed from the live tensors instead and returned once they were copied out. "
            if fell_back else "")
    return ("mode='device': too little free GPU memory for the snapshot (" + ", ".join(parts) + "); " + what +
            "Free GPU memory, or pick mode='lazy' (and call wait_staged() before changing the state) or mode='host'")


def capture(tensors: list[torch.Tensor], mode: AsyncMode | str, *, fall_back: bool = True,
            kept_memory: bool = False) -> Captured:
    """Capture ``tensors`` for a background save in ``mode`` (see the module's docstring).
    Where a device snapshot does not fit, it streams the live tensors instead ("lazy", saying
    why in ``fallback``), or, without ``fall_back``, raises ``torch.cuda.OutOfMemoryError``
    saying what to pick instead. ``kept_memory``: a "host" snapshot in the process's kept
    snapshot memory, which the caller gives back with ``finish()`` once the save has ended
    (a caller that cannot tell when nothing reads the snapshot any more leaves it out)."""
    mode = AsyncMode.parse(mode)
    with torch.no_grad():
        if mode is AsyncMode.DEVICE:
            snapshot = _device_snapshot(tensors)
            if snapshot is not None:
                return Captured(snapshot, mode, after=mark(snapshot))
            if not fall_back:
                raise torch.cuda.OutOfMemoryError(_short_memory_message(tensors, fell_back=False))
            captured = _lazy(tensors)
            captured.fallback = _short_memory_message(tensors)
            return captured
        if mode is AsyncMode.LAZY:
            return _lazy(tensors)
        return _host(tensors, kept_memory)


def _lazy(tensors: list[torch.Tensor]) -> Captured:
    live = [_copy(t, CPU) if t.device.type == "cpu" and _nbytes(t) <= BY_VALUE_BYTES else t for t in tensors]
    return Captured(live, AsyncMode.LAZY, after=mark(live), staged=False)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of ``device`` that "host" saves copy on (one per device, made at first use)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams.setdefault(device, torch.cuda.Stream(device))
    return stream


def _host(tensors: list[torch.Tensor], kept_memory: bool) -> Captured:
    cuda = [t for t in tensors if t.is_cuda]
    block: Block | None = None
    outs: list[torch.Tensor | None] = [None] * len(tensors)  # None: a new tensor
    if kept_memory:
        block, outs = _snapshot_memory(tensors, pinned=bool(cuda))
    try:
        return _host_copies(tensors, cuda, outs, block)
    except BaseException:
        if block is not None:
            for device in {t.device for t in cuda}:
                _side_stream(device).synchronize()  # no copy queued into the block still writes it
            MEMORY.give_back(block)
        raise


def _snapshot_memory(tensors: list[torch.Tensor], pinned: bool) -> tuple[Block | None,
                                                                         list[torch.Tensor | None]]:
    """A block of the kept snapshot memory and each tensor's place in it (None: no elements)."""
    offsets, size = layout(tensors)
    if not size:
        return None, [None] * len(tensors)
    block = MEMORY.take(size, pinned)
    outs: list[torch.Tensor | None] = []
    for t, at in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        outs.append(None if at is None else block.tensor[at : at + nbytes].view(t.dtype).view(tuple(t.shape)))
    return block, outs


def _host_copies(tensors: list[torch.Tensor], cuda: list[torch.Tensor], outs: list[torch.Tensor | None],
                 block: Block | None) -> Captured:
    copies: list[torch.Tensor | None] = [None if t.is_cuda else _copy(t, CPU, out=o)
                                         for t, o in zip(tensors, outs, strict=True)]
    if not cuda:
        return Captured([c for c in copies if c is not None], AsyncMode.HOST, block=block)
    events: dict[torch.device, torch.cuda.Event] = {}
    for device in sorted({t.device for t in cuda}, key=str):
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # every write queued before the call
        with torch.cuda.stream(stream):
            for i, t in enumerate(tensors):
                if t.device == device:
                    copies[i] = _copy(t, CPU, pin=True, out=outs[i])
        event = torch.cuda.Event(blocking=True)  # the worker sleeps on it instead of spinning a core
        event.record(stream)
        events[device] = event
    held = HostCopies(events, storage_keys(cuda))
    GUARD.arm(held)
    filled = [c for c in copies if c is not None]
    assert len(filled) == len(tensors)
    return Captured(filled, AsyncMode.HOST, ready=list(events.values()), copies=held, keep=cuda, block=block)
