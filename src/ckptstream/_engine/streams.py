"""How one transfer orders its copies between the staging buffers and device memory.

A ``Streams`` marks the point of each CUDA device's stream (the current one, or the one given)
that the transfer's copies must follow: where it is made, in the caller's thread, or earlier
through ``mark``. The engine then, from any thread:
- ``begin()``: a side stream per device waits for that point (a save copies what the kernels
  queued before it produce; a load does not overwrite memory they still read);
- ``enqueue(copy)`` inside ``copying()``: queue copies on the side streams (or, where
  ``copier(device)`` gives one, queue host-to-device copies by address without the
  interpreter lock, see ``cudart``);
- ``native(device, count)``: the calls of the native loop that moves a hot load's chunks
  (``hotloop``), queueing its copies on the same side stream;
- ``record(devices)``: events marking a chunk's copies, which the I/O thread waits for before
  it writes the staging buffer to the file, or refills it from the file;
- ``checksums(device, tensors)`` (or ``span_checksums``): CRC-32Cs computed on the device,
  queued after the copies; the function returned waits for the values;
- ``hand_back()`` (loads): the caller's streams wait for the copies, so work queued after the
  load sees the data; ``synchronize()``: nothing is in flight any more.
For host-only transfers every step is immediate. The CUDA primitives come from ``DEVICES``,
which tests replace by a simulator whose copies run only when something waits for them, so that
a missing wait shows on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from . import cudart, gpucrc, hotloop


def check_stream(stream: object) -> None:
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")


class CudaDevices:
    """The CUDA primitives that ``Streams`` orders copies with."""

    pins_staging = True  # asynchronous copies need page-locked staging buffers

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        """The device whose copies of ``t`` a staging buffer must wait for; None: host memory."""
        return t.device if t.is_cuda else None

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)  # from torch's stream pool: cheap

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[Any]:
        """Make ``stream`` current in this thread (copies to or from a tensor of its device go to it).

        Its device first: an I/O thread starts on device 0, where a stream context would first
        look up the current stream, which creates a CUDA context on device 0 (over 90 MiB of host
        memory, and GPU memory) in a process whose tensors live on another GPU."""
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield stream

    def event(self) -> Any:
        return torch.cuda.Event(blocking=True)  # I/O threads sleep on it instead of spinning a core

    def run(self, copy: Callable[[], None]) -> None:
        """Enqueue ``copy``'s device work on the current streams."""
        copy()

    def copies_by_address(self) -> bool:
        """Whether ``copier`` gives copies that do not hold the interpreter lock."""
        return cudart.runtime() is not None

    def copier(self, stream: Any) -> cudart.Copier | None:
        """Host-to-device copies by address on ``stream``, queued without the interpreter lock."""
        return cudart.copier(stream.cuda_stream)

    def native(self, stream: Any, count: int) -> hotloop.Calls | None:
        """The calls of the native hot-load loop on ``stream``, with ``count`` events of its own
        (made in this thread, on the stream's device: torch makes an event at its first record)."""
        calls = cudart.native_calls()
        if calls is None:
            return None
        events = [torch.cuda.Event(blocking=True) for _ in range(count)]  # a waiting thread sleeps
        for event in events:
            event.record(stream)
        return hotloop.Calls(*calls, stream=stream.cuda_stream, events=[e.cuda_event for e in events],
                             keep=events, name_of=cudart.error_name)

    def checksums_on_device(self, flat: torch.Tensor) -> bool:
        return flat.is_cuda and gpucrc.eligible(flat) and gpucrc.usable(flat.device)

    def checksums(self, tensors: list[torch.Tensor]) -> gpucrc.Waiter:
        """CRC-32Cs of contiguous byte tensors of one device, launched on the current stream:
        the function returned waits for them."""
        return gpucrc.launch(tensors)

    def span_checksums_on_device(self, memory: torch.Tensor, begins: Sequence[int], ends: Sequence[int]) -> bool:
        return memory.is_cuda and gpucrc.usable(memory.device) and gpucrc.spans_eligible(memory, begins, ends)

    def span_checksums(self, runs: Sequence[gpucrc.Spans]) -> gpucrc.Waiter:
        """CRC-32Cs of byte ranges of contiguous byte tensors of one device, as ``checksums``."""
        return gpucrc.launch_spans(runs)


DEVICES = CudaDevices()
Mark = dict[torch.device, tuple[Any, Any]]  # device -> (its caller's stream, an event recorded on it)


def mark(tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None = None) -> Mark:
    """The point that copies of ``tensors`` must follow: per device, its current stream (or
    ``stream``) and an event recorded on it now. An engine made later, or in another thread,
    takes it as ``after=`` (a background save orders its copies with the caller's work at the
    moment of the call, not with work queued since)."""
    check_stream(stream)
    out: Mark = {}
    for t in tensors:
        device = DEVICES.device_of(t)
        if device is not None and device not in out:
            caller = stream if stream is not None and stream.device == device else DEVICES.current_stream(device)
            out[device] = caller, caller.record_event()
    return out


class Streams:
    def __init__(self, tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None,
                 after: Mark | None = None) -> None:
        tensors = list(tensors)
        if after is None:
            after = mark(tensors, stream)
        missing = {DEVICES.device_of(t) for t in tensors} - set(after) - {None}
        if missing:
            raise ValueError(f"the ordering mark has no point for device(s) {sorted(map(str, missing))}")
        self.pinned = bool(after) and DEVICES.pins_staging
        self._caller = {device: caller for device, (caller, _) in after.items()}
        self._ready = {device: ready for device, (_, ready) in after.items()}
        self._side: dict[torch.device, Any] = {}
        self._copiers: dict[torch.device, cudart.Copier | None] = {}
        self._checking: dict[torch.device, Any] = {}  # per device: the stream of a load's device checksums
        self._checking_lock = threading.Lock()

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        return DEVICES.device_of(t)

    def begin(self) -> None:
        for device, ready in self._ready.items():
            side = DEVICES.new_stream(device)
            side.wait_event(ready)
            self._side[device] = side

    def copying(self) -> contextlib.ExitStack:
        """Make every device's side stream current in this thread, until the context exits."""
        stack = contextlib.ExitStack()
        for side in self._side.values():
            stack.enter_context(DEVICES.use(side))
        stack.enter_context(torch.no_grad())
        return stack

    def enqueue(self, copy: Callable[[], None]) -> None:
        DEVICES.run(copy)

    def copier(self, device: torch.device) -> cudart.Copier | None:
        """Host-to-device copies (device address, page-locked host address, bytes) on the side
        stream of ``device``, queued without the interpreter lock; None: copy through
        ``enqueue``. Only where the transfer has one device: the runtime queues a copy through
        the thread's current device, which ``copying()`` leaves at the last one."""
        if device not in self._copiers:  # threads racing here make the same one
            self._copiers[device] = DEVICES.copier(self._side[device]) if len(self._side) == 1 else None
        return self._copiers[device]

    def native(self, device: torch.device, count: int) -> hotloop.Calls | None:
        """The calls of the native hot-load loop on the side stream of ``device``, with
        ``count`` events; None where the loop is not built or the runtime not found, or the
        transfer has several devices (as ``copier``). In the I/O thread, inside ``copying()``."""
        if hotloop.LIBRARY is None or len(self._side) != 1:
            return None
        return DEVICES.native(self._side[device], count)

    def record(self, devices: Iterable[torch.device]) -> list[Any]:
        """Events marking the copies enqueued so far on the side streams of ``devices``."""
        events = []
        for device in devices:
            event = DEVICES.event()
            event.record(self._side[device])
            events.append(event)
        return events

    def checksums_on_device(self, flat: torch.Tensor) -> bool:
        """Whether a load checksums these bytes (a contiguous tensor's) on their device, once
        loaded, rather than from the staging buffers."""
        return DEVICES.device_of(flat) is not None and DEVICES.checksums_on_device(flat)

    def checksums(self, device: torch.device, tensors: list[torch.Tensor]) -> gpucrc.Waiter:
        """CRC-32Cs of contiguous byte tensors of ``device``, launched after the copies enqueued
        so far on its side stream (beside those queued later); the function returned waits for
        them."""
        with self._after_copies(device):
            return DEVICES.checksums(tensors)

    def span_checksums_on_device(self, memory: torch.Tensor, begins: Sequence[int], ends: Sequence[int]) -> bool:
        """Whether a load checksums these ranges of ``memory`` (many tensors' bytes in one
        allocation) on its device, once loaded."""
        return DEVICES.device_of(memory) is not None and DEVICES.span_checksums_on_device(memory, begins, ends)

    def span_checksums(self, device: torch.device, runs: Sequence[gpucrc.Spans]) -> gpucrc.Waiter:
        """CRC-32Cs of ranges of byte tensors of ``device`` (each run: a tensor, the ranges'
        begins and ends in it), in order, as ``checksums``."""
        with self._after_copies(device):
            return DEVICES.span_checksums(runs)

    @contextlib.contextmanager
    def _after_copies(self, device: torch.device) -> Iterator[None]:
        """A stream of the device's checksums, current, waiting for the copies queued so far on
        its side stream: what is queued now runs after those copies and beside the later ones
        (a kernel on the side stream itself would hold back every copy queued after it)."""
        with self._checking_lock:
            if device not in self._checking:
                self._checking[device] = DEVICES.new_stream(device)
            checking = self._checking[device]
            checking.wait_event(self._side[device].record_event())
        with DEVICES.use(checking), torch.no_grad():
            yield

    def hand_back(self) -> None:
        for device, side in self._side.items():  # (a load's checksum streams are done: their values were read)
            self._caller[device].wait_stream(side)

    def synchronize(self) -> None:
        for stream in [*self._side.values(), *self._checking.values()]:
            stream.synchronize()


make = Streams
