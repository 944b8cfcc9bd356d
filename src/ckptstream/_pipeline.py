"""The streaming engine: tensors <-> one byte range of a file, through a few staging buffers.

Save, per chunk: take a free buffer -> enqueue the device-to-host copies of the chunk's bytes on
a side stream (which first waits for the caller's stream) -> record an event -> an I/O thread
waits for that event, checksums and pwrites the buffer -> the buffer is free again.
Load mirrors it: each I/O thread owns some buffers; per chunk it claims the next one, waits until
the buffer's previous host-to-device copies are done, preads, enqueues the host-to-device copies
and checksums the buffer while the device reads it -> an event marks when the buffer is free again.
Many small tensors share one chunk; one large tensor spans many chunks.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from . import _checksum, _fileio, _gpucrc
from ._buffers import POOL, StagingBuffer
from ._errors import TruncatedFileError
from ._layout import copy_in, copy_out, flat_bytes
from ._settings import Settings
from ._streams import Streams

Progress = Callable[[int], None]
PieceCrcs = list[tuple[int, int, int]]  # (span, CRC-32C, length) of pieces, in file order
T = TypeVar("T")


@dataclasses.dataclass
class Span:
    """A tensor's logical bytes at ``offset`` in the file; ``tensor=None`` reads bytes only
    (to checksum them)."""

    tensor: torch.Tensor | None
    offset: int
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor, offset: int) -> Span:
        return cls(tensor, offset, tensor.numel() * tensor.element_size())


@dataclasses.dataclass
class Piece:
    span: int  # index into the span list
    lo: int  # byte range inside the span's tensor
    hi: int
    buf_lo: int  # where those bytes sit in the staging buffer


@dataclasses.dataclass
class Chunk:
    index: int
    start: int  # file byte range of the chunk
    stop: int
    grid: int  # file offset that the staging buffer's byte 0 stands for (aligned)
    pieces: list[Piece]


def plan_chunks(spans: Sequence[Span], buffer_size: int, align: int) -> list[Chunk]:
    """Cut the back-to-back spans into chunks on a grid of ``buffer_size`` aligned to ``align``,
    so that every chunk but the first starts on an aligned file offset (O_DIRECT)."""
    if not spans:
        return []
    begin, end = spans[0].offset, spans[-1].offset + spans[-1].nbytes
    starts = [s.offset for s in spans]
    chunks: list[Chunk] = []
    grid = _fileio.round_down(begin, align)
    while grid < end:
        start, stop = max(begin, grid), min(end, grid + buffer_size)
        pieces = []
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(spans) and spans[i].offset < stop:
            s = spans[i]
            lo, hi = max(start, s.offset), min(stop, s.offset + s.nbytes)
            if hi > lo:
                pieces.append(Piece(i, lo - s.offset, hi - s.offset, lo - grid))
            i += 1
        chunks.append(Chunk(len(chunks), start, stop, grid, pieces))
        grid += buffer_size
    return chunks


class _Tasks:
    """The I/O tasks and worker threads of one transfer, run through a gate that ``close`` shuts.

    A KeyboardInterrupt can land inside ``ThreadPoolExecutor.submit`` after it queued the task and
    started a new worker, but before it recorded that worker, which ``shutdown`` then never joins:
    such a worker could still fill a staging buffer already back in the pool, or write to a closed
    (maybe reused) descriptor. So no task starts once the gate is shut, and ``close`` waits for
    the running ones and joins every worker of the transfer, found by its unique name prefix.
    """

    def __init__(self, kind: str) -> None:
        self.prefix = f"ckptstream-{kind}-{next(_TRANSFERS)}"
        self._cv = threading.Condition()
        self._open, self._running = True, 0

    def run(self, fn: Callable[..., T], *args: Any) -> T | None:
        with self._cv:
            if not self._open:
                return None
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()

    def close(self) -> None:
        """Call after the executor's shutdown (its workers, idle, then exit)."""
        with self._cv:
            self._open = False
            self._cv.wait_for(lambda: self._running == 0)
        for t in threading.enumerate():  # also lists threads still starting
            if t.name.startswith(self.prefix + "_"):
                while True:
                    try:
                        t.join()
                        break
                    except RuntimeError:  # started, not running yet
                        time.sleep(0.001)


_TRANSFERS = itertools.count()


class _Run:
    """State shared by the caller's thread and the I/O threads of one transfer."""

    def __init__(self, ep: _fileio.Endpoint, spans: Sequence[Span], cfg: Settings, writing: bool,
                 stream: torch.cuda.Stream | None, progress: Progress | None) -> None:
        self.ep, self.spans, self.cfg = ep, spans, cfg
        tensors = [s.tensor for s in spans if s.tensor is not None]
        self.streams = Streams(tensors, stream)
        align = _fileio.ALIGN
        # auto: O_DIRECT for writes with aligned buffers; reads keep the page cache
        direct = cfg.direct_io if cfg.direct_io is not None else writing and cfg.buffer_size % align == 0
        if direct and ep.direct_fd is None:
            ep.direct_fd = _fileio.open_direct(ep.fd, ep.path, force=bool(cfg.direct_io))
        self.direct_fd = ep.direct_fd if direct else None  # an endpoint may serve several runs
        self.chunks = plan_chunks(spans, cfg.buffer_size, align if self.direct_fd is not None else 1)
        self.carries: dict[int, torch.Tensor] = {}
        # per span, made once: contiguous tensors' bytes (their pieces need no layout work) and
        # the CUDA device whose copies the staging buffers wait for
        self.flat = [flat_bytes(t) if t is not None and t.is_contiguous() else None for t in (s.tensor for s in spans)]
        self.device = [t.device if t is not None and t.is_cuda else None for t in (s.tensor for s in spans)]
        self._progress, self._progress_lock = progress, threading.Lock()
        self.tasks = _Tasks("write" if writing else "read")

    def progressed(self, nbytes: int) -> None:
        if self._progress is not None:
            with self._progress_lock:
                self._progress(nbytes)

    def copying(self) -> contextlib.ExitStack:
        """The context in which a thread enqueues this transfer's copies (``_copy_pieces``)."""
        stack = self.streams.use_side()
        stack.enter_context(torch.no_grad())
        return stack

    def carry(self, span: int, t: torch.Tensor) -> torch.Tensor:
        if span not in self.carries:
            self.carries[span] = torch.empty(t.element_size(), dtype=torch.uint8, device=t.device)
        return self.carries[span]


def _copy_pieces(run: _Run, chunk: Chunk, buf: StagingBuffer, *, load: bool, ordered: bool = False) -> list[torch.cuda.Event]:
    """Enqueue the device copies between ``buf`` and the chunk's tensors; events mark their end.
    Runs inside ``run.copying()``.

    A load splits the pieces: those of contiguous tensors are copied in any order; those of
    non-contiguous ones (``ordered``) in chunk order (``_Turns``), because an element cut by a
    chunk edge waits in a carry for the next chunk.
    """
    devices: set[torch.device | None] = set()
    for p in chunk.pieces:
        t, flat = run.spans[p.span].tensor, run.flat[p.span]
        if t is None or (load and (flat is None) != ordered):
            continue
        staged = buf.tensor[p.buf_lo : p.buf_lo + p.hi - p.lo]
        if flat is not None:
            if load:
                flat[p.lo : p.hi].copy_(staged, non_blocking=True)
            else:
                staged.copy_(flat[p.lo : p.hi], non_blocking=True)
        elif load:
            copy_in(staged, t, p.lo, p.hi, run.carry(p.span, t))
        else:
            copy_out(t, p.lo, p.hi, staged)
        devices.add(run.device[p.span])
    return run.streams.record(d for d in devices if d is not None)


def _buffers_for(run: _Run) -> list[StagingBuffer]:
    count = min(run.cfg.num_buffers, len(run.chunks))
    return POOL.acquire(run.cfg.buffer_size, count, pinned=run.streams.cuda)


def _finish(run: _Run, buffers: list[StagingBuffer], pool: concurrent.futures.ThreadPoolExecutor,
            failed: bool) -> None:
    """Join the I/O threads and return the buffers once no device copy can touch them."""
    pool.shutdown(wait=True, cancel_futures=True)
    run.tasks.close()
    try:
        run.streams.synchronize()
    except BaseException:
        if not failed:
            raise
        return  # the device is in an error state: never hand these buffers to another transfer
    POOL.release(buffers)


def _crc_pieces(chunk: Chunk, buf: StagingBuffer, on_device: Sequence[bool] = ()) -> PieceCrcs:
    """(span, CRC-32C, length) of each of the chunk's pieces, from the staging buffer, but for
    the spans checksummed ``on_device`` after the load."""
    return [(p.span, _checksum.crc_of(buf.view[p.buf_lo : p.buf_lo + p.hi - p.lo]), p.hi - p.lo)
            for p in chunk.pieces if not (on_device and on_device[p.span])]


def write_spans(ep: _fileio.Endpoint, spans: Sequence[Span], cfg: Settings, *,
                stream: torch.cuda.Stream | None = None, checksum: bool = False,
                progress: Progress | None = None) -> list[int]:
    """Write the spans' tensors to ``ep``; returns their CRC-32Cs when ``checksum``."""
    run = _Run(ep, spans, cfg, True, stream, progress)
    if not run.chunks:
        return [0] * len(spans) if checksum else []  # nothing to move: the CRC of no bytes
    buffers = _buffers_for(run)
    free: queue.Queue[StagingBuffer] = queue.Queue()
    for b in buffers:
        free.put(b)
    errors: list[BaseException] = []
    pool = concurrent.futures.ThreadPoolExecutor(min(cfg.io_threads, len(buffers)), run.tasks.prefix)
    crcs: list[PieceCrcs] = [[] for _ in run.chunks]  # per chunk

    def write_chunk(chunk: Chunk, buf: StagingBuffer, events: list[torch.cuda.Event]) -> None:
        try:
            for event in events:
                event.synchronize()
            if checksum:  # a save waits for the disk, not for this
                crcs[chunk.index] = _crc_pieces(chunk, buf)
            _write_chunk(run, chunk, buf)
            run.progressed(chunk.stop - chunk.start)
        except BaseException as e:
            errors.append(e)
        finally:
            free.put(buf)

    ok = False
    try:
        with run.copying():
            for chunk in run.chunks:
                buf = free.get()
                if errors:
                    raise errors[0]
                events = _copy_pieces(run, chunk, buf, load=False)
                pool.submit(run.tasks.run, write_chunk, chunk, buf, events)
        pool.shutdown(wait=True)
        if errors:
            raise errors[0]
        ok = True
    finally:
        _finish(run, buffers, pool, failed=not ok)
    # folded in file order here: the threads finish chunks in any order
    return _checksum.span_crcs(len(spans), crcs) if checksum else []


def _write_chunk(run: _Run, chunk: Chunk, buf: StagingBuffer) -> None:
    """pwrite one chunk; with O_DIRECT the aligned middle goes direct, unaligned edges buffered
    (padding the edges instead would overwrite bytes that follow in an existing file)."""
    ep, a = run.ep, _fileio.ALIGN
    lo, hi = chunk.start, chunk.stop
    if run.direct_fd is not None:
        a_lo, a_hi = _fileio.round_up(lo, a), _fileio.round_down(hi, a)
        if a_lo < a_hi:
            _fileio.pwrite_all(run.direct_fd, buf.view[a_lo - chunk.grid : a_hi - chunk.grid], a_lo, ep.path)
            _fileio.pwrite_all(ep.fd, buf.view[lo - chunk.grid : a_lo - chunk.grid], lo, ep.path)
            _fileio.pwrite_all(ep.fd, buf.view[a_hi - chunk.grid : hi - chunk.grid], a_hi, ep.path)
            return
    _fileio.pwrite_all(ep.fd, buf.view[lo - chunk.grid : hi - chunk.grid], lo, ep.path)


def _read_chunk(run: _Run, chunk: Chunk, buf: StagingBuffer) -> None:
    """pread one chunk in one call (from a hot page cache, 256 KiB reads ran at a third of the
    speed of 16 MiB ones on the H200 machine)."""
    ep = run.ep
    if run.direct_fd is not None:  # whole aligned blocks; bytes beyond the chunk are ignored
        lo = _fileio.round_down(chunk.start, _fileio.ALIGN)
        hi = _fileio.round_up(chunk.stop, _fileio.ALIGN)
        got = _fileio.pread_into(run.direct_fd, buf.view[lo - chunk.grid : hi - chunk.grid], lo, ep.path)
    else:
        lo = chunk.start
        got = _fileio.pread_into(ep.fd, buf.view[lo - chunk.grid : chunk.stop - chunk.grid], lo, ep.path)
    if lo + got < chunk.stop:  # the file ends at lo + got: report it for the whole read
        begin, end = run.chunks[0].start, run.chunks[-1].stop
        raise TruncatedFileError(ep.path, begin, end - begin, max(0, lo + got - begin))


def read_spans(ep: _fileio.Endpoint, spans: Sequence[Span], cfg: Settings, *,
               stream: torch.cuda.Stream | None = None, checksum: bool = False,
               progress: Progress | None = None) -> list[int]:
    """Fill the spans' tensors from ``ep``; returns the CRC-32Cs of the bytes read when ``checksum``.

    Each I/O thread owns some of the buffers and claims the next chunk as soon as one of them is
    free, so no thread waits for another's chunk (nor for the caller's thread) unless the chunk
    holds non-contiguous tensors, whose copies take turns in chunk order (see ``_copy_pieces``).
    """
    run = _Run(ep, spans, cfg, False, stream, progress)
    if not run.chunks:
        return [0] * len(spans) if checksum else []  # nothing to move: the CRC of no bytes
    on_device = _on_device(run) if checksum else []
    buffers = _buffers_for(run)
    threads = min(cfg.io_threads, len(buffers))
    pool = concurrent.futures.ThreadPoolExecutor(threads, run.tasks.prefix)
    crcs: list[PieceCrcs] = [[] for _ in run.chunks]  # per chunk
    claim, claim_lock = iter(run.chunks), threading.Lock()
    turns = _Turns([c.index for c in run.chunks
                    if any(spans[p.span].tensor is not None and run.flat[p.span] is None for p in c.pieces)])

    def read_chunks(own: list[StagingBuffer]) -> None:
        copies: dict[int, list[torch.cuda.Event]] = {id(b): [] for b in own}  # still reading each buffer
        chunk = None
        try:
            with run.copying():
                for buf in itertools.cycle(own):
                    with claim_lock:
                        chunk = None if turns.failed else next(claim, None)
                    if chunk is None:
                        return
                    for event in copies[id(buf)]:
                        event.synchronize()
                    _read_chunk(run, chunk, buf)
                    copies[id(buf)] = _copy_pieces(run, chunk, buf, load=True)
                    if turns.wait(chunk.index):
                        copies[id(buf)] += _copy_pieces(run, chunk, buf, load=True, ordered=True)
                        turns.done()
                    if checksum:  # while the device copies
                        crcs[chunk.index] = _crc_pieces(chunk, buf, on_device)
                    run.progressed(chunk.stop - chunk.start)
        except _Stopped:
            pass
        except BaseException as e:
            errors.append((chunk.index if chunk else -1, e))
            turns.fail()  # the other threads stop at their next chunk

    errors: list[tuple[int, BaseException]] = []
    ok = False
    try:
        for future in [pool.submit(run.tasks.run, read_chunks, buffers[i::threads]) for i in range(threads)]:
            future.result()
        if errors:  # the first in file order (a file cut short reports where it ends)
            raise min(errors, key=lambda ie: ie[0])[1]
        values = _checksum.span_crcs(len(spans), crcs) if checksum else []  # folded in file order
        if any(on_device):
            with run.copying():  # queued after the copies
                for picked in _by_device(run, on_device).values():  # spans with bytes on a device: flat is set
                    for i, crc in zip(picked, _gpucrc.crcs([run.flat[i] for i in picked]), strict=True):  # type: ignore[misc]
                        values[i] = crc
        run.streams.hand_back()
        ok = True
    finally:
        turns.fail()  # after an interrupt here, the threads stop at their next chunk
        _finish(run, buffers, pool, failed=not ok)
    return values


def _on_device(run: _Run) -> list[bool]:
    """Which spans a load checksums on their device once loaded, not from the staging buffers
    (see _gpucrc): those of large contiguous CUDA tensors."""
    return [flat is not None and device is not None and _gpucrc.eligible(flat) and _gpucrc.usable(device)
            for flat, device in zip(run.flat, run.device, strict=True)]


def _by_device(run: _Run, picked: list[bool]) -> dict[torch.device | None, list[int]]:
    out: dict[torch.device | None, list[int]] = {}
    for i, p in enumerate(picked):
        if p:
            out.setdefault(run.device[i], []).append(i)
    return out


class _Turns:
    """Chunk order for the copies into non-contiguous tensors, across the I/O threads.

    Such a copy may leave the leading bytes of an element cut by the chunk's end in a carry,
    which the next chunk's copy completes, so those chunks enqueue their copies in file order.
    Threads claim chunks in file order, so the thread whose turn it is never waits for a later one.
    """

    def __init__(self, ordered: list[int]) -> None:
        self._ordered, self._next = set(ordered), iter(sorted(ordered))
        self._turn = next(self._next, None)
        self._cv = threading.Condition()
        self.failed = False

    def wait(self, index: int) -> bool:
        """Whether chunk ``index`` has such copies; if so, wait for its turn."""
        if index not in self._ordered:
            return False
        with self._cv:
            self._cv.wait_for(lambda: self._turn == index or self.failed)
            if self.failed:
                raise _Stopped()
        return True

    def done(self) -> None:
        with self._cv:
            self._turn = next(self._next, None)
            self._cv.notify_all()

    def fail(self) -> None:
        with self._cv:
            self.failed = True
            self._cv.notify_all()


class _Stopped(Exception):
    """A thread waiting for its turn learns that the transfer failed elsewhere."""
