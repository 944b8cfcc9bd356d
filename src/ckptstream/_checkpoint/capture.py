"""What a background save reads, captured in the caller's thread at the call.

Each mode turns the state's tensors (in file order) into the tensors the worker streams, and
says when the caller may change the state again:

- CPU tensors are copied at the call (by value), so that a CPU ``step`` counter or RNG state
  changed right after the call is never written beside device tensors of another step; in
  "lazy" mode only those of up to BY_VALUE_BYTES (a large CPU tensor streams like a device
  tensor, under the same ``wait_staged`` rule).
- Device tensor copies are queued on each device's current stream: they run after the work
  queued before the call and before any work queued after it, so the next optimizer step cannot
  change a tensor before its copy has read it. The snapshot belongs to the save alone until the
  engine has synchronized its copies out of it.
- The engine's ordering point (``mark``) is taken here, after those copies: the worker's engine,
  made later in another thread, orders its own copies after it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from .._engine import Mark, copyable, empty_tensor, mark


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
    staged: bool = True  # the caller may change the state at once
    fallback: str = ""  # why "device" became "lazy"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy(t: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    """A contiguous copy of ``t`` on ``device`` (a pinned host tensor with ``pin``), queued on the
    current stream of ``t``'s device when either side is a GPU."""
    if pin and t.numel():
        out = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
    else:
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


def capture(tensors: list[torch.Tensor], mode: AsyncMode | str, *, fall_back: bool = True) -> Captured:
    """Capture ``tensors`` for a background save in ``mode`` (see the module's docstring).
    Where a device snapshot does not fit, it streams the live tensors instead ("lazy", saying
    why in ``fallback``), or, without ``fall_back``, raises ``torch.cuda.OutOfMemoryError``
    saying what to pick instead."""
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
        return _host(tensors)


def _lazy(tensors: list[torch.Tensor]) -> Captured:
    live = [_copy(t, CPU) if t.device.type == "cpu" and _nbytes(t) <= BY_VALUE_BYTES else t for t in tensors]
    return Captured(live, AsyncMode.LAZY, after=mark(live), staged=False)


def _host(tensors: list[torch.Tensor]) -> Captured:
    pin = torch.cuda.is_available()
    copies = [_copy(t, CPU, pin=pin and t.is_cuda) for t in tensors]
    devices = {t.device for t in tensors if t.is_cuda}
    ready = []
    for device in devices:  # the worker reads the host copies once the copies into them are done
        event = torch.cuda.Event(blocking=True)  # it sleeps on it instead of spinning a core
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    return Captured(copies, AsyncMode.HOST, ready=ready)
