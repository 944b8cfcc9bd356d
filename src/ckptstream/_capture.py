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
from typing import Any

import torch

from ._engine import Mark, copyable, mark
from ._header import empty_tensor

MODES = ("device", "lazy", "host")
BY_VALUE_BYTES = 1 << 20  # "lazy": CPU tensors up to this size are still captured by value
CPU = torch.device("cpu")


class SnapshotFallbackWarning(UserWarning):
    """``save_async(mode="device")`` found too little free GPU memory for its snapshot: it
    streamed from the live tensors and returned once they were copied out (a stall)."""


@dataclasses.dataclass
class Captured:
    """The tensors a worker streams and when the state may change."""

    tensors: list[torch.Tensor]
    mode: str  # the mode in effect
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


def _short_memory_message(tensors: list[torch.Tensor]) -> str:
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
    return ("save_async(mode='device'): too little free GPU memory for the snapshot (" + ", ".join(parts) + "); "
            "the save streamed from the live tensors instead and returned once they were copied out. Free GPU "
            "memory, or pick mode='lazy' (and call wait_staged() before changing the state) or mode='host'")


def capture(tensors: list[torch.Tensor], mode: str) -> Captured:
    """Capture ``tensors`` for a background save in ``mode`` (see the module's docstring)."""
    with torch.no_grad():
        if mode == "device":
            snapshot = _device_snapshot(tensors)
            if snapshot is not None:
                return Captured(snapshot, mode, after=mark(snapshot))
            captured = _lazy(tensors)
            captured.fallback = _short_memory_message(tensors)
            return captured
        if mode == "lazy":
            return _lazy(tensors)
        if mode == "host":
            return _host(tensors)
    raise ValueError(f"unknown mode {mode!r}")


def _lazy(tensors: list[torch.Tensor]) -> Captured:
    live = [_copy(t, CPU) if t.device.type == "cpu" and _nbytes(t) <= BY_VALUE_BYTES else t for t in tensors]
    return Captured(live, "lazy", after=mark(live), staged=False)


def _host(tensors: list[torch.Tensor]) -> Captured:
    pin = torch.cuda.is_available()
    copies = [_copy(t, CPU, pin=pin and t.is_cuda) for t in tensors]
    devices = {t.device for t in tensors if t.is_cuda}
    ready = []
    for device in devices:  # the worker reads the host copies once the copies into them are done
        event = torch.cuda.Event(blocking=True)  # it sleeps on it instead of spinning a core
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    return Captured(copies, "host", ready=ready)
