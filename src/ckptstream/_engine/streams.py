"""How one transfer orders its copies between the staging buffers and device memory.

A ``Streams`` marks the point of each CUDA device's stream (the current one, or the one given)
that the transfer's copies must follow: where it is made, in the caller's thread, or earlier
through ``mark``. The engine then, from any thread:
- ``begin()``: a side stream per device waits for that point (a save copies what the kernels
  queued before it produce; a load does not overwrite memory they still read);
- ``enqueue(copy)`` inside ``copying()``: queue copies on the side streams;
- ``record(devices)``: events marking a chunk's copies, which the I/O thread waits for before
  it writes the staging buffer to the file, or refills it from the file;
- ``checksums(device, tensors)``: CRC-32Cs computed on the device, queued after the copies;
- ``hand_back()`` (loads): the caller's streams wait for the copies, so work queued after the
  load sees the data; ``synchronize()``: nothing is in flight any more.
For host-only transfers every step is immediate. Tests replace ``make`` with a double whose
copies run late, so that a missing wait shows on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from . import gpucrc


def check_stream(stream: object) -> None:
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")


Mark = dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Event]]


def mark(tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None = None) -> Mark:
    """The point that copies of ``tensors`` must follow: per CUDA device, its current stream (or
    ``stream``) and an event recorded on it now. An engine made later, or in another thread,
    takes it as ``after=`` (a background save orders its copies with the caller's work at the
    moment of the call, not with work queued since)."""
    check_stream(stream)
    out: Mark = {}
    for device in dict.fromkeys(t.device for t in tensors if t.is_cuda):
        caller = stream if stream is not None and stream.device == device else torch.cuda.current_stream(device)
        out[device] = caller, caller.record_event()
    return out


class Streams:
    def __init__(self, tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None,
                 after: Mark | None = None) -> None:
        tensors = list(tensors)
        if after is None:
            after = mark(tensors, stream)
        missing = {t.device for t in tensors if t.is_cuda} - set(after)
        if missing:
            raise ValueError(f"the ordering mark has no point for device(s) {sorted(map(str, missing))}")
        self.pinned = bool(after)  # staging buffers must be page-locked for async copies
        self._caller = {device: caller for device, (caller, _) in after.items()}
        self._ready = {device: ready for device, (_, ready) in after.items()}
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        """The device whose copies of ``t`` a staging buffer must wait for; None: host memory."""
        return t.device if t.is_cuda else None

    def begin(self) -> None:
        for device, ready in self._ready.items():
            side = torch.cuda.Stream(device=device)  # from torch's stream pool: cheap
            side.wait_event(ready)
            self._side[device] = side

    def copying(self) -> contextlib.ExitStack:
        """Make every device's side stream current in this thread (a copy to or from a tensor
        goes to the current stream of its device), until the returned context exits."""
        stack = contextlib.ExitStack()
        for side in self._side.values():
            stack.enter_context(torch.cuda.stream(side))
        stack.enter_context(torch.no_grad())
        return stack

    def enqueue(self, copy: Callable[[], None]) -> None:
        copy()

    def record(self, devices: Iterable[torch.device]) -> list[torch.cuda.Event]:
        """Events marking the copies enqueued so far on the side streams of ``devices``."""
        events = []
        for device in devices:
            event = torch.cuda.Event(blocking=True)  # I/O threads sleep on it instead of spinning a core
            event.record(self._side[device])
            events.append(event)
        return events

    def checksums_on_device(self, flat: torch.Tensor) -> bool:
        """Whether a load checksums these bytes (a contiguous tensor's) on their device, once
        loaded, rather than from the staging buffers."""
        return flat.is_cuda and gpucrc.eligible(flat) and gpucrc.usable(flat.device)

    def checksums(self, tensors: list[torch.Tensor]) -> list[int]:
        """CRC-32Cs of contiguous byte tensors of one device, on the current stream (call in
        ``copying()``, after the copies were enqueued); waits for them."""
        return gpucrc.crcs(tensors)

    def hand_back(self) -> None:
        for device, side in self._side.items():
            self._caller[device].wait_stream(side)

    def synchronize(self) -> None:
        for side in self._side.values():
            side.synchronize()


make = Streams
