"""A simulated GPU for the CPU test suite: streams whose work runs only when something waits.

On a real GPU a copy enqueued on a stream runs some time later, in stream order, after whatever
the stream was told to wait for. A missing wait (an I/O thread that writes a staging buffer
before the copy into it ran, a side stream that does not wait for the caller's kernels, a
buffer refilled while a copy still reads it, a checksum launched on the wrong stream) goes
unseen on the CPU, where every copy is immediate. ``SimDevices`` replaces the CUDA primitives of
``ckptstream._engine.streams`` and treats CPU tensors as device tensors: each stream keeps a
queue of operations, and an operation runs only when an event recorded after it, or the stream,
is synchronized, as late as a GPU could run it. A missing wait then leaves stale or poisoned
bytes where the data should be.

Install with the ``simulated_gpu`` fixture of the tests that use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import crc32c
import torch

DEVICE = torch.device("cpu")  # the simulated device's tensors are ordinary CPU tensors


class SimStream:
    """A queue of operations run in order, lazily."""

    def __init__(self, name: str) -> None:
        self.name, self.device = name, DEVICE
        self._ops: list[Callable[[], None]] = []
        self._done = 0
        self._lock = threading.RLock()

    def enqueue(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)

    def queued(self) -> int:
        with self._lock:
            return len(self._ops)

    def run_to(self, count: int) -> None:
        """Run the first ``count`` operations (those not run yet)."""
        with self._lock:
            while self._done < count:
                op = self._ops[self._done]
                self._done += 1
                op()

    def record_event(self) -> SimEvent:
        event = SimEvent()
        event.record(self)
        return event

    def wait_event(self, event: SimEvent) -> None:
        # the stream's later operations wait for the event: running this one runs the other stream to it
        self.enqueue(event.synchronize)

    def wait_stream(self, other: SimStream) -> None:
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.run_to(self.queued())


class SimEvent:
    def __init__(self) -> None:
        self._stream: SimStream | None = None
        self._count = 0

    def record(self, stream: SimStream) -> None:
        self._stream, self._count = stream, stream.queued()

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_to(self._count)


class SimDevices:
    """Stands in for ``ckptstream._engine.streams.CudaDevices``."""

    pins_staging = False

    def __init__(self, copies_by_address: bool = True) -> None:
        self.by_address = copies_by_address  # False: as where no CUDA runtime is found
        self.copied_by_address = 0  # bytes queued that way
        self.native_calls = 0  # threads that took the native loop's calls
        self.default = SimStream("default")  # the caller's stream
        self._local = threading.local()
        self.streams: list[SimStream] = [self.default]

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        return DEVICE

    def current_stream(self, device: torch.device) -> SimStream:
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self, device: torch.device) -> SimStream:
        stream = SimStream(f"side-{len(self.streams)}")
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def event(self) -> SimEvent:
        return SimEvent()

    def run(self, copy: Callable[[], None]) -> None:
        self.current_stream(DEVICE).enqueue(copy)

    def copies_by_address(self) -> bool:
        return self.by_address

    def copier(self, stream: SimStream) -> Callable[[int, int, int], None] | None:
        """Copies by address, queued on ``stream`` as ``cudaMemcpyAsync`` would be."""
        if not self.by_address:
            return None

        def copy(dst: int, src: int, nbytes: int) -> None:
            def run() -> None:
                ctypes.memmove(dst, src, nbytes)
            self.copied_by_address += nbytes
            stream.enqueue(run)
        return copy

    def native(self, stream: SimStream, count: int) -> Any:
        """The native hot-load loop's calls as C callbacks into this simulator: its copies are
        queued on ``stream`` like the copier's, its events are ``count`` SimEvents (handles
        1..count), so that the loop's waits are checked as the Python loop's are."""
        from ckptstream._engine import hotloop

        if not self.by_address:
            return None
        events = [SimEvent() for _ in range(count)]

        def memcpy_async(dst: int, src: int, nbytes: int, kind: int, _stream: int | None) -> int:
            self.copier(stream)(dst, src, nbytes)  # type: ignore[misc]
            return 0

        def record(event: int, _stream: int | None) -> int:
            events[event - 1].record(stream)
            return 0

        def synchronize(event: int) -> int:
            events[event - 1].synchronize()
            return 0

        P, I64 = ctypes.c_void_p, ctypes.c_int64
        fns = (ctypes.CFUNCTYPE(ctypes.c_int, P, P, I64, ctypes.c_int, P)(memcpy_async),
               ctypes.CFUNCTYPE(ctypes.c_int, P, P)(record), ctypes.CFUNCTYPE(ctypes.c_int, P)(synchronize))
        self.native_calls += 1
        copy, mark, wait = (ctypes.cast(f, ctypes.c_void_p).value or 0 for f in fns)
        return hotloop.Calls(copy, mark, wait, stream=0, events=list(range(1, count + 1)), keep=(fns, events),
                             name_of=lambda status: "simulated")

    def checksums_on_device(self, flat: torch.Tensor) -> bool:
        return flat.numel() >= 64  # most tensors, so that the path is taken

    def checksums(self, tensors: list[torch.Tensor]) -> Callable[[], list[int]]:
        """Queued on the current stream, as the kernel is; the function returned waits for
        that stream, as its ``tolist()`` does."""
        out: list[int] = []
        stream = self.current_stream(DEVICE)
        stream.enqueue(lambda: out.extend(crc32c.crc32c(t.numpy().tobytes()) for t in tensors))

        def wait() -> list[int]:
            stream.synchronize()
            return out
        return wait

    def span_checksums_on_device(self, memory: torch.Tensor, begins: Sequence[int], ends: Sequence[int]) -> bool:
        return bool(begins)

    def span_checksums(self, runs: Sequence[tuple[torch.Tensor, Sequence[int], Sequence[int]]]
                       ) -> Callable[[], list[int]]:
        """As ``checksums``, of ranges of tensors' bytes."""
        return self.checksums([memory[b:e] for memory, begins, ends in runs for b, e in zip(begins, ends, strict=True)])

    def producer(self, work: Callable[[], None]) -> None:
        """Queue ``work`` on the caller's stream, as a kernel that writes a tensor would be."""
        self.default.enqueue(work)

    def drain(self) -> None:
        for stream in self.streams:
            stream.synchronize()
