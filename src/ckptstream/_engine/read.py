"""The read engine: file -> tensors.

Per chunk, on the I/O thread that claimed it: wait until the staging buffer's previous
host-to-device copies are done -> read the chunk from the source -> enqueue the copies into the
tensors (side streams) -> record events (the buffer is free again once they complete) ->
checksum the buffer while the device copies it. Loads into CUDA tensors checksum large
contiguous tensors on the device instead, once every copy is queued (see gpucrc): every launch
first, then the wait for their values.

Copies into non-contiguous tensors take turns in file order across the threads: an element cut
by a chunk's end waits in a carry until the next chunk completes it.

A hot load into one GPU gives each thread a contiguous range of the chunks; a range whose every
chunk is plain (contiguous device tensors, copied by address, checksummed on the device) moves
in a few calls of the native loop (hotloop), the same steps without the interpreter lock. Between
two calls the thread launches the device checksums of the tensors whose every chunk has been
queued by then, by any thread: they run on the side stream while the rest is read, rather than
all after the last copy.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from .. import _checksum
from .._errors import TruncatedFileError
from .._settings import ALIGN, DirectIO, Settings
from .._storage import Source, round_down, round_up
from . import gpucrc, hotloop, streams
from .buffers import StagingBuffer
from .control import Failure, Stopped
from .engine import BATCH, At, Engine
from .plan import Chunk, Part, Piece
from .tensor_bytes import copy_in

log = logging.getLogger(__name__)

# A native range is moved in up to SEGMENTS calls of at least SEGMENT_FROM bytes each: between two,
# the checksums of the tensors complete by then are launched (docs/benchmarks.md, "The hot-load
# loop in C"; a launch costs the interpreter lock for about a tenth of a millisecond).
SEGMENTS, SEGMENT_FROM = 4, 64 << 20


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _scatter(staged: torch.Tensor, flats: list[torch.Tensor]) -> None:
    """Many small device tensors' bytes from the staging buffer: one copy to the device, then
    one scatter (instead of one copy, and its launch, each)."""
    scratch = torch.empty(staged.numel(), dtype=torch.uint8, device=flats[0].device)
    scratch.copy_(staged, non_blocking=True)
    torch._foreach_copy_(flats, list(scratch.split([f.numel() for f in flats])))


HOT_FROM = 64 << 20  # smaller loads finish before more threads would pay
HOT_SHARE = 0.9  # of the bytes in the page cache: a hot load


class ReadEngine(Engine[Source]):
    """Fills each piece's tensor bytes from its file offset (pieces may overlap).

    With ``spans`` (file ranges, sorted, disjoint, each inside one piece), ``wait`` returns the
    CRC-32C of each span rather than of each piece: a load may move many tensors that share one
    allocation as one piece, padding and all, and still check each tensor on its own.
    """

    writing = False
    resident = False  # a load from the page cache (set by ``tune``)

    def __init__(self, *args: Any, spans: Sequence[tuple[int, int]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, list[Any]] = {}  # per staging buffer: the events of its copies
        self._carries: dict[int, torch.Tensor] = {}  # per non-contiguous piece
        self._carry_order = _CarryOrder([c.index for c in self.chunks if self._has_ordered(c)], self.failure)
        self._spans = spans
        self._span_starts = [begin for begin, _ in spans or ()]
        self._span_ends = [end for _, end in spans or ()]
        # per piece, with spans: the span that is exactly the piece's bytes, if one is
        self._span_of: list[int | None] = [None] * len(self.pieces)
        for i, p in enumerate(self.pieces if spans is not None else ()):
            at = bisect.bisect_left(self._span_starts, p.offset)
            if at < len(self._span_starts) and spans[at] == (p.offset, p.end):  # type: ignore[index]
                self._span_of[i] = at
        # pieces checksummed on their device once loaded, not from the staging buffers
        self.on_device = [self.checksum and flat is not None and (spans is None or self._span_of[i] is not None)
                          and self.streams.checksums_on_device(flat[p.lo : p.hi])
                          for i, (p, flat) in enumerate(zip(self.pieces, self.flat, strict=True))]
        # pieces checksummed by the span kernel on their device: those that hold several spans
        # (a run of small tensors), and those too small for the whole-tensor kernel (all go in
        # one launch, so a small tensor costs no launch of its own): per piece, the ranges of
        # its bytes and where their values go
        self._spans_of = self._device_spans() if self.checksum else {}
        for i in self._spans_of:
            self.on_device[i] = True
        # per piece checksummed on its device: its parts not yet queued, counted down by the
        # native loop's calls; a piece at 0 has its checksum launched then (``_launch_moved``)
        self._checks_on_device = any(self.on_device)
        self._unqueued = [0] * len(self.pieces)
        for chunk in self.chunks if self._checks_on_device else ():
            for part in chunk.parts:
                self._unqueued[part.piece] += self.on_device[part.piece]
        self._launched = [False] * len(self.pieces)
        self._early: list[tuple[gpucrc.Waiter, Sequence[int]]] = []  # checksums launched while the load runs
        self._early_lock = threading.Lock()
        # chunks read straight into host tensors: no staging buffer, no second copy (where the
        # source reads anywhere: a grid's whole blocks need the aligned staging buffers)
        self._unstaged = [self.grid == 1 and _host_runs(c, self.host) for c in self.chunks]
        self._local = threading.local()  # per I/O thread: its reader
        self._native_events: list[Any] = []  # the native loop's events, kept while copies may run
        # per piece in device memory: the address of its bytes (for copies by address)
        self._address = [f.data_ptr() if f is not None and d is not None else 0
                         for f, d in zip(self.flat, self.device, strict=True)]

    def _device_spans(self) -> dict[int, tuple[list[int], list[int], Sequence[int]]]:
        """Per device piece the span kernel can checksum, not checksummed otherwise on its
        device: its spans (or its bytes, as one span) as ranges of the piece's bytes, and the
        indices of their values (span indices, or the piece's own without spans)."""
        out: dict[int, tuple[list[int], list[int], Sequence[int]]] = {}
        spans, starts = self._spans, self._span_starts
        for i, (p, flat) in enumerate(zip(self.pieces, self.flat, strict=True)):
            if flat is None or self.device[i] is None or self.on_device[i] or p.hi == p.lo:
                continue
            where: Sequence[int]
            if spans is None or self._span_of[i] is not None:  # the piece is one tensor's bytes
                begins, ends, where = [0], [p.hi - p.lo], [i if spans is None else self._span_of[i]]  # type: ignore[list-item]
            else:
                first, stop = bisect.bisect_left(starts, p.offset), bisect.bisect_left(starts, p.end)
                begins, ends = self._relative(i, first, stop)
                where = range(first, stop)
            if self.streams.span_checksums_on_device(flat[p.lo : p.hi], begins, ends):
                out[i] = begins, ends, where
        return out

    def _relative(self, piece: int, first: int, stop: int) -> tuple[list[int], list[int]]:
        """Spans ``first``..``stop`` as byte ranges of the piece's bytes."""
        at = self.pieces[piece].offset
        spans = self._spans[first:stop]  # type: ignore[index]
        return [b - at for b, _ in spans], [e - at for _, e in spans]

    def staged_chunks(self) -> int:
        return self._unstaged.count(False)

    def claims(self, count: int) -> list[Callable[[], Chunk | None]]:
        """Each thread reads one contiguous range of the chunks, in order, on a reader of its
        own: the kernel's readahead then follows every thread's sequential stream (a disk's
        rate, where chunks taken in turn on one descriptor got less; docs/benchmarks.md).
        Chunks of non-contiguous tensors keep the turns (their copies go in file order across
        the threads, which ranges would serialise), and so do sources without such readers
        (an object store: a ranged request per chunk wherever it lies)."""
        if count <= 1 or self._carry_order.any or self.grid != 1 or not self.file.sequential_readers:
            log.debug("%s: chunks taken in turns by %d thread(s)", self.file.name, count)
            return super().claims(count)
        ranges = [_Range(r, self.failure, self.resident and all(map(self._plain, r)))
                  for r in _split(self.chunks, count)]
        log.debug("%s: one contiguous range of the chunks per thread (%s chunks; %d for the native loop)",
                  self.file.name, "/".join(str(len(r.chunks)) for r in ranges), sum(r.native for r in ranges))
        return list(ranges)

    def _plain(self, chunk: Chunk) -> bool:
        """Whether the native loop can move the chunk: every part a contiguous device tensor's,
        copied by address, none checksummed from the staging buffer."""
        return self.grid == 1 and not self._unstaged[chunk.index] and all(
            self.flat[p.piece] is not None and self.device[p.piece] is not None
            and (not self.checksum or self.on_device[p.piece])
            and self.streams.copier(self.device[p.piece]) is not None for p in chunk.parts)  # type: ignore[arg-type]

    def _loop(self, own: list[StagingBuffer | None], take: Callable[[], Chunk | None], io: object, at: At) -> None:
        if not (isinstance(take, _Range) and take.native and self._native_loop(own, take.chunks, io, at)):
            super()._loop(own, take, io, at)

    def _native_loop(self, own: list[StagingBuffer | None], chunks: Sequence[Chunk], io: object, at: At) -> bool:
        """Move the thread's range of chunks in a few calls of the native loop (hotloop), each
        without the interpreter lock, the checksums complete after each launched; False, having
        moved nothing, where it is not built, the runtime not found, or the reader has no
        descriptor."""
        fd = io.descriptor() if isinstance(io, Source) else None
        buffers = [b for b in own if b is not None]
        device = self.device[chunks[0].parts[0].piece]
        if fd is None or not buffers or device is None:
            return False
        calls = self.streams.native(device, len(buffers))
        if calls is None:
            return False
        self._native_events.append(calls.keep)  # until the streams are synchronized
        nbytes = sum(c.stop - c.start for c in chunks)
        segments = _split(chunks, max(1, min(SEGMENTS, nbytes // SEGMENT_FROM)))
        address = self._address
        for k, segment in enumerate(segments):
            if k:
                calls.wait_all()  # each call's loop fills the buffers afresh
            table = [(c.start, c.start - c.origin, c.stop - c.start, c.stop - c.start) for c in segment]
            parts = [[(p.at, address[p.piece] + p.lo, p.hi - p.lo) for p in c.parts] for c in segment]
            result = hotloop.run(fd, [b.ptr for b in buffers], calls, table, parts, self.failure.flag)
            at.index = segment[result.chunk].index
            self._progressed(result.moved)
            if result.file_end is not None:
                self._truncated(result.file_end)
            result.check(self.file.name, table[result.chunk], calls)
            if self._checks_on_device:
                self._launch_moved(segment)
        return True

    def _launch_moved(self, segment: Sequence[Chunk]) -> None:
        """Count down the parts of ``segment`` (their copies are queued) and launch the
        checksums of the pieces that no thread has a part of left to queue: they follow those
        copies on the side stream (copies are queued there before they are counted)."""
        with self._early_lock:
            done = []
            for chunk in segment:
                for part in chunk.parts:
                    i = part.piece
                    if self.on_device[i] and not self._launched[i]:
                        self._unqueued[i] -= 1
                        if self._unqueued[i] == 0:
                            self._launched[i] = True
                            done.append(i)
        if done:
            launched = self._launch_checksums(done)
            with self._early_lock:
                self._early += launched

    @contextlib.contextmanager
    def thread_io(self) -> Iterator[object]:
        reader = self.file.reader(resident=self.resident)
        self._local.reader = reader
        try:
            yield reader
        finally:
            del self._local.reader
            if reader is not self.file:
                reader.close()

    def _source(self) -> Source:
        """This thread's reader (the source itself outside the I/O threads)."""
        return getattr(self._local, "reader", self.file)

    def tune(self, cfg: Settings, file: Source, pieces: Sequence[Piece]) -> Settings:
        """A load from a file the page cache holds is bound by memory copies, not by the disk:
        then more readers (hot_io_threads, up to the cores), the same staging split among them.
        A load into a GPU gets them only where its copies are queued without the interpreter
        lock (``cudart``): copies queued through torch hold the lock, and more readers with
        smaller buffers then loaded no faster (docs/benchmarks.md, "A copy loop without the
        interpreter lock"; there, too, one buffer per reader beat two of half the size)."""
        threads = min(cfg.hot_io_threads, os.cpu_count() or 1)
        moved = [p for p in pieces if p.hi > p.lo]
        if threads <= cfg.io_threads or cfg.direct_io is DirectIO.ON or not moved:
            return cfg
        devices = {streams.DEVICES.device_of(p.tensor) for p in moved if p.tensor is not None} - {None}
        if devices and (len(devices) > 1 or not streams.DEVICES.copies_by_address()):
            return cfg
        begin, end = min(p.offset for p in moved), max(p.end for p in moved)
        if end - begin < HOT_FROM or (file.resident_fraction(begin, end - begin) or 0) < HOT_SHARE:
            return cfg
        count = max(threads, cfg.num_buffers)
        size = max(ALIGN, cfg.buffer_size * cfg.num_buffers // count // ALIGN * ALIGN)
        log.debug("%s: hot load into %s: %d readers, %d buffers of %d bytes (configured: %d, %d x %d)",
                  file.name, "a device" if devices else "host memory", threads, count, size, cfg.io_threads,
                  cfg.num_buffers, cfg.buffer_size)
        self.resident = True
        return dataclasses.replace(cfg, io_threads=threads, buffer_size=size, num_buffers=count)

    def _has_ordered(self, chunk: Chunk) -> bool:
        """Whether the chunk holds parts of non-contiguous tensors."""
        return any(self.pieces[p.piece].tensor is not None and self.flat[p.piece] is None
                   and self.host[p.piece] is None for p in chunk.parts)

    def _move(self, chunk: Chunk, buf: StagingBuffer | None) -> None:
        if self._unstaged[chunk.index]:
            self._read_into_host(chunk)
            return
        assert buf is not None
        for event in self._pending.get(id(buf), ()):
            event.synchronize()  # the buffer's previous copies are done: it may be refilled
        self._read(chunk, buf)
        events = self._copy_parts(chunk, buf, ordered=False)
        if self._carry_order.wait(chunk.index):
            events += self._copy_parts(chunk, buf, ordered=True)
            self._carry_order.done()
        self._pending[id(buf)] = events
        if self.checksum:  # while the device copies
            view = buf.view
            self._chunk_crcs(chunk, lambda p: view[p.at : p.at + p.hi - p.lo])

    def _launch_checksums(self, pieces: Sequence[int]) -> list[tuple[gpucrc.Waiter, Sequence[int]]]:
        """Launch the checksums of ``pieces`` (checksummed on their device), after their copies:
        per device, one launch for the spans (of runs of small tensors, and of tensors too small
        for the other kernel: a launch costs more than their bytes), one for the other pieces.
        Returns the functions that wait for each launch's values, with where those values go."""
        launched: list[tuple[gpucrc.Waiter, Sequence[int]]] = []
        whole: dict[Any, list[int]] = {}
        runs: dict[Any, list[int]] = {}
        for i in pieces:
            (runs if i in self._spans_of else whole).setdefault(self.device[i], []).append(i)
        for device, pieces in runs.items():
            taken = [self._spans_of[i] for i in pieces]
            wait = self.streams.span_checksums(device, [(self._bytes(i), b, e) for i, (b, e, _) in zip(pieces, taken,
                                                                                                   strict=True)])
            launched.append((wait, [at for _, _, where in taken for at in where]))
        for device, pieces in whole.items():
            wait = self.streams.checksums(device, [self._bytes(i) for i in pieces])
            launched.append((wait, pieces if self._spans is None else [self._span_of[i] for i in pieces]))  # type: ignore[misc]
        return launched

    def _bytes(self, piece: int) -> torch.Tensor:
        p = self.pieces[piece]
        return self.flat[piece][p.lo : p.hi]  # type: ignore[index]

    def _copy_parts(self, chunk: Chunk, buf: StagingBuffer, *, ordered: bool) -> list[Any]:
        """Enqueue the copies of the chunk's parts into contiguous tensors (or, ``ordered``,
        into non-contiguous ones); returns events that mark their end. Host tensors' parts are
        copied at once."""
        devices, view = set(), buf.view
        for kind, parts in self.segments(chunk):
            if (kind == "strided") != ordered:
                continue
            part = parts[0]
            i = part.piece
            if kind == "host":
                self.host[i][part.lo : part.hi] = view[part.at : part.at + part.hi - part.lo]  # type: ignore[index]
                continue
            devices.add(self.device[i])
            if kind == "strided":
                t = self.pieces[i].tensor
                assert t is not None
                self.streams.enqueue(partial(copy_in, self.staged(buf, part), t, part.lo, part.hi, self._carry(i, t)))
            elif len(parts) >= BATCH:
                end = parts[-1].at + parts[-1].hi - parts[-1].lo
                flats = [self.flat[p.piece][p.lo : p.hi] for p in parts]  # type: ignore[index]
                self.streams.enqueue(partial(_scatter, buf.tensor[part.at : end], flats))
            elif (copy := self.streams.copier(self.device[i])) is not None:  # type: ignore[arg-type]
                address = self._address
                for p in parts:
                    copy(address[p.piece] + p.lo, buf.ptr + p.at, p.hi - p.lo)
            else:
                for p in parts:
                    self.streams.enqueue(partial(_copy, self.flat[p.piece][p.lo : p.hi], self.staged(buf, p)))  # type: ignore[index]
        return self.streams.record(d for d in devices if d is not None)

    def _read_into_host(self, chunk: Chunk) -> None:
        """Read a chunk of host tensors' bytes straight into them, run by run of back-to-back
        parts, and checksum them there."""
        runs: list[tuple[int, list[memoryview]]] = []
        end = -1
        for part in chunk.parts:
            pos = chunk.origin + part.at
            view = self.host[part.piece][part.lo : part.hi]  # type: ignore[index]
            if pos != end:
                runs.append((pos, []))
            runs[-1][1].append(view)
            end = pos + part.hi - part.lo
        for pos, views in runs:
            nbytes = sum(len(v) for v in views)
            got = self._source().readv_into(views, pos)
            if got < nbytes:
                self._truncated(pos + got)
        if self.checksum:
            self._chunk_crcs(chunk, lambda p: self.host[p.piece][p.lo : p.hi])  # type: ignore[index]

    def _chunk_crcs(self, chunk: Chunk, data: Callable[[Part], memoryview]) -> None:
        """Note the CRC-32C of the chunk's bytes of each piece (or, with spans, of each span),
        given each part's bytes; pieces checksummed on their device are left out."""
        skip, crc_of = self.on_device, _checksum.crc_of
        if self._spans is None:
            self.part_crcs[chunk.index] = [(p.piece, crc_of(data(p)), p.hi - p.lo)
                                           for p in chunk.parts if not skip[p.piece]]
            return
        spans, starts, ends, crcs = self._spans, self._span_starts, self._span_ends, []
        for p in chunk.parts:
            if skip[p.piece]:
                continue
            begin = chunk.origin + p.at
            end = begin + p.hi - p.lo
            mv = data(p)
            first, stop = bisect.bisect_left(starts, begin), bisect.bisect_right(ends, end)
            # the spans inside the part (a run holds thousands) in one comprehension, then those it cuts
            crcs += [(s, crc_of(mv[b - begin : e - begin]), e - b) for s, (b, e) in enumerate(spans[first:stop], first)]
            for s in sorted({first - 1, stop}):  # the same span where one holds the whole part
                if not first <= s < stop and 0 <= s < len(spans) and spans[s][0] < end and spans[s][1] > begin:
                    lo, hi = max(spans[s][0], begin), min(spans[s][1], end)
                    crcs.append((s, crc_of(mv[lo - begin : hi - begin]), hi - lo))
        self.part_crcs[chunk.index] = crcs

    def _truncated(self, file_end: int) -> None:
        """Report a file that ends at ``file_end`` for the whole read (or earlier, as its size
        says now: a thread whose range starts past the end found nothing there, which does not
        tell where the end is)."""
        with contextlib.suppress(OSError):
            file_end = min(file_end, self.file.size())
        begin, end = self.chunks[0].start, max(c.stop for c in self.chunks)
        raise TruncatedFileError(self.file.name, begin, end - begin, max(0, file_end - begin))

    def _carry(self, piece: int, t: torch.Tensor) -> torch.Tensor:
        if piece not in self._carries:
            self._carries[piece] = torch.empty(t.element_size(), dtype=torch.uint8, device=t.device)
        return self._carries[piece]

    def _read(self, chunk: Chunk, buf: StagingBuffer) -> None:
        """Read one chunk in one call (from a hot page cache, small reads run at a fraction of
        the speed of whole-buffer ones); on a grid, its whole blocks (bytes beyond the chunk are
        ignored)."""
        origin, grid = chunk.origin, self.grid
        lo, hi = round_down(chunk.start, grid), round_up(chunk.stop, grid)
        got = self._source().read_into(buf.view[lo - origin : hi - origin], lo)
        if lo + got < chunk.stop:  # the file ends at lo + got
            self._truncated(lo + got)

    def _result(self) -> list[int]:
        count = len(self.pieces if self._spans is None else self._spans)
        values = _checksum.span_crcs(count, self.part_crcs) if self.checksum else []
        rest = [i for i, picked in enumerate(self.on_device) if picked and not self._launched[i]]
        for wait, where in self._early + self._launch_checksums(rest):
            for at, crc in zip(where, wait(), strict=True):
                values[at] = crc
        self.streams.hand_back()
        return values


def _split(chunks: Sequence[Chunk], count: int) -> list[Sequence[Chunk]]:
    """``chunks`` (in file order) cut into ``count`` contiguous runs of about equal bytes."""
    total = sum(c.stop - c.start for c in chunks)
    cuts, done = [0], 0
    for i, c in enumerate(chunks):
        done += c.stop - c.start
        if len(cuts) < count and done * count >= total * len(cuts):
            cuts.append(i + 1)
    cuts.append(len(chunks))
    return [chunks[a:b] for a, b in itertools.pairwise(cuts) if b > a]


class _Range:
    """One I/O thread's contiguous range of chunks, taken in order (``native``: every chunk
    plain, for the native loop)."""

    def __init__(self, chunks: Sequence[Chunk], failure: Failure, native: bool) -> None:
        self.chunks, self.native = chunks, native
        self._next, self._failure = iter(chunks), failure

    def __call__(self) -> Chunk | None:
        return None if self._failure.stopped else next(self._next, None)


def _host_runs(chunk: Chunk, host: list[memoryview | None]) -> bool:
    """Whether every part of the chunk is a host tensor's, in file order without overlap (holes
    are fine: each run of back-to-back parts is one read)."""
    end = -1
    for part in chunk.parts:
        pos = chunk.origin + part.at
        if host[part.piece] is None or pos < end:
            return False
        end = pos + part.hi - part.lo
    return True


class _CarryOrder:
    """File order for the copies into non-contiguous tensors, across the I/O threads.

    Threads claim chunks in file order, so the thread whose turn it is never waits for a later
    one; a thread waiting for its turn stops when the transfer fails elsewhere.
    """

    def __init__(self, ordered: Sequence[int], failure: Failure) -> None:
        self._ordered, self._next = set(ordered), iter(sorted(ordered))
        self._turn = next(self._next, None)
        self._cv = threading.Condition()
        self._failure = failure

    @property
    def any(self) -> bool:
        """Whether any chunk holds parts of non-contiguous tensors."""
        return bool(self._ordered)

    def wait(self, index: int) -> bool:
        """Whether chunk ``index`` has such copies; if so, wait for its turn."""
        if index not in self._ordered:
            return False
        with self._cv:
            while self._turn != index:
                if self._failure.stopped:
                    raise Stopped()
                self._cv.wait(0.05)  # wakes on done(), or to look at the failure
        return True

    def done(self) -> None:
        with self._cv:
            self._turn = next(self._next, None)
            self._cv.notify_all()
