"""What the write engine and the read engine share: the plan, the staging buffers, the I/O
threads that each own some buffers and claim chunks in file order, the failure they share, and
the way a transfer is started, waited on and cancelled from outside.

    engine = WriteEngine(file, pieces, settings, checksum=True)   # in the caller's thread
    with engine:             # leaving the block early cancels it and joins its threads
        engine.start()       # any thread
        crcs = engine.wait() # the first error is raised here; the buffers are back
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from .. import _checksum
from .._fileio import OpenFile
from .._settings import ALIGN, DirectIO, Settings
from . import control, streams
from .buffers import POOL, StagingBuffer
from .layout import flat_bytes
from .plan import Chunk, Part, Piece, check_pieces, plan

Progress = Callable[[int], None]
PartCrcs = list[tuple[int, int, int]]  # (piece, CRC-32C, length) of one chunk's parts, in order

_ENGINES = itertools.count()


class Engine:
    """Moves ``pieces`` between tensors and ``file`` through staging buffers, on I/O threads of
    its own. Its copies follow the work queued on the CUDA streams of the thread that makes it
    (or on ``stream``) before it was made, or before ``after = streams.mark(...)`` was taken;
    ``start``, ``wait``, ``cancel`` and ``done`` may then be called from any thread."""

    writing: ClassVar[bool]

    def __init__(self, file: OpenFile, pieces: Sequence[Piece], cfg: Settings, *,
                 stream: torch.cuda.Stream | None = None, after: streams.Mark | None = None,
                 checksum: bool = False, progress: Progress | None = None) -> None:
        check_pieces(pieces, writing=self.writing)
        self.file, self.pieces, self.cfg, self.checksum = file, pieces, cfg, checksum
        self.streams = streams.make((p.tensor for p in pieces if p.tensor is not None), stream, after)
        direct = cfg.direct_io is DirectIO.ON or (
            cfg.direct_io is DirectIO.AUTO and self.writing and cfg.buffer_size % ALIGN == 0)
        self.direct_fd = file.direct_fd(force=cfg.direct_io is DirectIO.ON) if direct else None
        self.chunks = plan(pieces, cfg.buffer_size, ALIGN if self.direct_fd is not None else 1)
        # per piece, made once: a contiguous tensor's bytes (its parts need no layout work) and
        # the device whose copies a staging buffer waits for
        self.flat = [flat_bytes(p.tensor) if p.tensor is not None and p.tensor.is_contiguous() else None
                     for p in pieces]
        self.device = [self.streams.device_of(p.tensor) if p.tensor is not None else None for p in pieces]
        self.failure = control.Failure()
        self.part_crcs: list[PartCrcs] = [[] for _ in self.chunks]
        self._claim, self._claim_lock = iter(self.chunks), threading.Lock()
        self._progress, self._progress_lock = progress, threading.Lock()
        self._threads: list[threading.Thread] = []
        self._buffers: list[StagingBuffer] = []
        self._started = self._finished = False

    # --- from outside ---------------------------------------------------------------------

    def start(self) -> Engine:
        """Take staging buffers and start the I/O threads."""
        if self._started:
            raise RuntimeError("an engine starts once")
        self._started = True
        if not self.chunks:
            return self
        self._buffers = POOL.acquire(self.cfg.buffer_size, min(self.cfg.num_buffers, len(self.chunks)),
                                     pinned=self.streams.pinned)
        self.streams.begin()
        count = min(self.cfg.io_threads, len(self._buffers))
        name = f"ckptstream-{'write' if self.writing else 'read'}-{next(_ENGINES)}"
        for i in range(count):
            thread = threading.Thread(target=self._thread, args=(self._buffers[i::count],), name=f"{name}-{i}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
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

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started and not self._finished:
            self.cancel()
            try:
                control.join(self._threads)
            finally:
                self._release()

    # --- the I/O threads ------------------------------------------------------------------

    def _thread(self, own: list[StagingBuffer]) -> None:
        chunk = None
        try:
            with self.streams.copying():
                for buf in itertools.cycle(own):
                    with self._claim_lock:
                        chunk = None if self.failure.stopped else next(self._claim, None)
                    if chunk is None:
                        return
                    self._move(chunk, buf)
                    self._progressed(chunk.stop - chunk.start)
        except control.Stopped:
            pass
        except BaseException as e:
            self.failure.record(e, chunk.index if chunk is not None else -1)

    def _move(self, chunk: Chunk, buf: StagingBuffer) -> None:
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

    def host_crcs(self, chunk: Chunk, buf: StagingBuffer, skip: Sequence[bool] = ()) -> None:
        """Note the CRC-32C of each of the chunk's parts, from the staging buffer (but those of
        pieces checksummed elsewhere)."""
        self.part_crcs[chunk.index] = [
            (p.piece, _checksum.crc_of(buf.view[p.at : p.at + p.hi - p.lo]), p.hi - p.lo)
            for p in chunk.parts if not (skip and skip[p.piece])]
