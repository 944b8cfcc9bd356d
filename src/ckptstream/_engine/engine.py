"""What the write engine and the read engine share: the plan, the staging buffers, the I/O
threads that each own some buffers and claim chunks (in file order, or in a read engine's
ranges), the failure they share, and
the way a transfer is started, waited on and cancelled from outside. They move bytes through a
storage target (a ``Sink`` to write, a ``Source`` to read), which says the grid to plan on.

    engine = WriteEngine(sink, pieces, settings, checksum=True)   # in the caller's thread
    with engine:             # leaving the block early cancels it and joins its threads
        engine.start()       # any thread
        crcs = engine.wait() # the first error is raised here; the buffers are back
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Generic, TypeVar

import torch

from .. import _checksum, _gc
from .._errors import ThreadStartError
from .._settings import Settings
from .._storage import Target
from . import control, streams
from .buffers import POOL, StagingBuffer
from .plan import Chunk, Part, Piece, check_pieces, plan
from .tensor_bytes import flat_bytes, host_bytes

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
PartCrcs = list[tuple[int, int, int]]  # (piece, CRC-32C, length) of one chunk's parts, in order

_ENGINES = itertools.count()
BATCH = 8  # device parts in a run from which one copy and one gather / scatter kernel move them


T = TypeVar("T", bound=Target)


class At:
    """The chunk an I/O thread is at (-1: none yet): where its error, if any, lies in the file."""

    index = -1


class Engine(Generic[T]):
    """Moves ``pieces`` between tensors and ``file`` through staging buffers, on I/O threads of
    its own. Its copies follow the work queued on the CUDA streams of the thread that makes it
    (or on ``stream``) before it was made, or before ``after = streams.mark(...)`` was taken;
    ``start``, ``wait``, ``cancel`` and ``done`` may then be called from any thread."""

    writing: ClassVar[bool]

    def __init__(self, file: T, pieces: Sequence[Piece], cfg: Settings, *,
                 stream: torch.cuda.Stream | None = None, after: streams.Mark | None = None,
                 checksum: bool = False, progress: Progress | None = None) -> None:
        check_pieces(pieces, writing=self.writing)
        cfg = self.tune(cfg, file, pieces)
        self.file, self.pieces, self.cfg, self.checksum = file, pieces, cfg, checksum
        self.streams = streams.make((p.tensor for p in pieces if p.tensor is not None), stream, after)
        self.grid = file.grid(cfg.buffer_size, cfg.direct_io)
        with _gc.paused():
            self.chunks = plan(pieces, cfg.buffer_size, self.grid)
            self._route(pieces)
        self.failure = control.Failure()
        self.part_crcs: list[PartCrcs] = [[] for _ in self.chunks]
        self._claim, self._claim_lock = iter(self.chunks), threading.Lock()
        self._progress, self._progress_lock = progress, threading.Lock()
        self._threads: list[threading.Thread] = []
        self._buffers: list[StagingBuffer] = []
        self._started = self._finished = False

    def _route(self, pieces: Sequence[Piece]) -> None:
        """Per piece, made once: how its bytes move. A contiguous host tensor's bytes are a
        memoryview (``host``: copies and checksums without torch calls, which cost more than
        small tensors' bytes); a device tensor's a flat uint8 view (``flat``: one device copy
        per part), with the device whose copies a staging buffer waits for (``device``); a
        non-contiguous tensor's go through ``tensor_bytes`` (neither)."""
        n = len(pieces)
        self.host: list[memoryview | None] = [None] * n
        self.flat: list[torch.Tensor | None] = [None] * n
        self.device: list[torch.device | None] = [None] * n
        device_of = self.streams.device_of
        for i, (t, _, lo, hi) in enumerate(pieces):
            if t is None or hi == lo:
                continue
            device = self.device[i] = device_of(t)
            if not t.is_contiguous():
                continue
            if device is None and t.is_cpu:
                self.host[i] = host_bytes(t)
            else:
                self.flat[i] = flat_bytes(t)

    # --- from outside ---------------------------------------------------------------------

    def start(self) -> Engine[T]:
        """Take staging buffers and start the I/O threads."""
        if self._started:
            raise RuntimeError("an engine starts once")
        self._started = True
        if not self.chunks:
            return self
        staged = self.staged_chunks()
        if staged:
            self._buffers = POOL.acquire(self.cfg.buffer_size, min(self.cfg.num_buffers, staged),
                                         pinned=self.streams.pinned)
        self.streams.begin()
        count = min(self.cfg.io_threads, len(self._buffers) or len(self.chunks))
        name = f"ckptstream-{'write' if self.writing else 'read'}-{next(_ENGINES)}"
        log.debug("%s %s: %d chunks on a grid of %d, %d I/O threads, %d staging buffers of %d bytes%s", name,
                  self.file.name, len(self.chunks), self.grid, count, len(self._buffers), self.cfg.buffer_size,
                  " (pinned)" if self.streams.pinned else "")
        for i, take in enumerate(self.claims(count)):
            own: list[StagingBuffer | None] = [*self._buffers[i::count]] or [None]  # no staging needed
            thread = threading.Thread(target=self._thread, args=(own, take), name=f"{name}-{i}", daemon=True)
            self._threads.append(thread)  # before it starts: an interrupt right after must find it
            try:
                control.start(thread, f"I/O thread {i + 1} of {count} for {self.file.name}")
            except ThreadStartError:
                self._threads.pop()  # never started: leaving the engine joins those that run
                raise
        return self

    def cancel(self) -> None:
        """Stop the threads at their next chunk; ``wait`` then raises TransferCancelled."""
        self.failure.stop()

    def done(self) -> bool:
        return self._started and not any(t.is_alive() for t in self._threads)

    def wait(self, timeout: float | None = None) -> list[int]:
        """Wait for the transfer; returns the CRC-32C of each piece's bytes when ``checksum``
        (else []). Raises the first error (in file order), TransferCancelled after ``cancel``,
        or TimeoutError (the transfer goes on) when ``timeout`` seconds pass first."""
        if not self._started:
            raise RuntimeError("start the engine before waiting for it")
        if timeout is not None:
            deadline = time.monotonic() + timeout
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if not self.done():
                raise TimeoutError(f"the transfer did not finish within {timeout} s")
        try:
            control.join(self._threads)
            self.failure.raise_first()
            return self._result()
        finally:
            self._release()

    def run(self) -> list[int]:
        """Start and wait; in the main thread a Ctrl-C stops the transfer and is raised once
        its threads are joined."""
        with control.interrupts_deferred(self.cancel), self:
            self.start()
            return self.wait()

    def __enter__(self) -> Engine[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started and not self._finished:
            self.cancel()
            try:
                control.join(self._threads)
            finally:
                self._release()

    # --- the I/O threads ------------------------------------------------------------------

    def tune(self, cfg: Settings, file: T, pieces: Sequence[Piece]) -> Settings:
        """The settings of this transfer (an engine may adapt them to its work)."""
        return cfg

    def staged_chunks(self) -> int:
        """How many chunks go through staging buffers (all, unless an engine moves some without)."""
        return len(self.chunks)

    def claims(self, count: int) -> list[Callable[[], Chunk | None]]:
        """Per I/O thread, how it takes its next chunk (None: no more): here each thread takes
        the next chunk in file order."""
        def take() -> Chunk | None:
            with self._claim_lock:
                return None if self.failure.stopped else next(self._claim, None)
        return [take] * count

    def thread_io(self) -> contextlib.AbstractContextManager[object]:
        """What an I/O thread holds while it runs (an engine may open a reader of its own)."""
        return contextlib.nullcontext()

    def _thread(self, own: list[StagingBuffer | None], take: Callable[[], Chunk | None]) -> None:
        at = At()
        try:
            with self.streams.copying(), self.thread_io() as io:
                self._loop(own, take, io, at)
        except control.Stopped:
            pass
        except BaseException as e:
            self.failure.record(e, at.index)

    def _loop(self, own: list[StagingBuffer | None], take: Callable[[], Chunk | None], io: object, at: At) -> None:
        """An I/O thread's work: chunk by chunk, each through the thread's next buffer."""
        for buf in itertools.cycle(own):
            chunk = take()
            if chunk is None:
                return
            at.index = chunk.index
            self._move(chunk, buf)
            self._progressed(chunk.stop - chunk.start)

    def _move(self, chunk: Chunk, buf: StagingBuffer | None) -> None:
        raise NotImplementedError

    def _result(self) -> list[int]:
        return _checksum.span_crcs(len(self.pieces), self.part_crcs) if self.checksum else []

    def _progressed(self, nbytes: int) -> None:
        if self._progress is not None:
            with self._progress_lock:
                self._progress(nbytes)

    def _release(self) -> None:
        """Return the buffers once no device copy can touch them any more (exactly once)."""
        if self._finished:
            return
        self._finished = True
        try:
            self.streams.synchronize()
        except BaseException:
            if self.failure.error is None:
                raise
            return  # the device is in an error state: never hand these buffers to another transfer
        POOL.release(self._buffers)

    # --- helpers of both engines ----------------------------------------------------------

    def staged(self, buf: StagingBuffer, part: Part) -> torch.Tensor:
        return buf.tensor[part.at : part.at + part.hi - part.lo]

    def segments(self, chunk: Chunk) -> Iterator[tuple[str, list[Part]]]:
        """The chunk's parts of tensors, in order, as ("host", [part]), ("strided", [part]) or
        ("device", parts): a run of contiguous device tensors' parts on one device, back to
        back in the staging buffer, which an engine may move in one host-device copy."""
        run: list[Part] = []
        for part in chunk.parts:
            i = part.piece
            if self.flat[i] is not None:
                if run and (self.device[run[-1].piece] != self.device[i]
                            or run[-1].at + run[-1].hi - run[-1].lo != part.at):
                    yield "device", run
                    run = []
                run.append(part)
                continue
            if run:
                yield "device", run
                run = []
            if self.host[i] is not None:
                yield "host", [part]
            elif self.pieces[i].tensor is not None:
                yield "strided", [part]
        if run:
            yield "device", run
