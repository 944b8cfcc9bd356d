"""The export's mover: one output file's tensors, from the boxes of their sources' bytes into a
sink, window by window through staging buffers.

The output file is planned as the write engine plans a save (``_engine.plan``: chunks of one
staging buffer on the sink's grid, so O_DIRECT writes apply as in a save). Each I/O thread owns
one staging buffer (and, where a tensor is cast, one scratch buffer of the same size) and
takes chunks in file order: for every part of an output tensor in the chunk, the runs of source
bytes that fill it (a box of a DTensor sharded on dimension 1 holds one run per row) are read
straight into the buffer, back-to-back runs of one file in one vectored read; a cast reads into
the scratch buffer and converts with torch's own ``copy_``. The chunk's CRC-32C per tensor part
is taken from the buffer, then the chunk is written at its offset. Host memory is the staging
buffers and the runs of one window, whatever the tensors' sizes.

The sources' checksums are checked on the way: a box read whole and written unchanged has the
output's CRC-32C; other boxes' runs are checksummed as read and folded in order. A mismatch
fails the export before its file is published.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import NamedTuple

from .. import _checksum
from .._engine import Piece
from .._engine.buffers import POOL, StagingBuffer
from .._engine.control import Failure, interrupts_deferred, join
from .._engine.plan import Chunk, Part, plan
from .._errors import CorruptCheckpointError, TruncatedFileError
from .._settings import ALIGN, Settings
from .._storage import Sink, Source, round_down, storage_for
from .plan import Box, OutTensor


class _Runs:
    """The row-major runs of a box's elements inside its tensor: run ``j`` starts at element
    ``start(j)`` of the tensor and holds ``length`` elements, which are elements
    ``j * length``.. of the box's bytes. The dimensions after ``k`` are whole in the box, so
    each run is ``sizes[k]`` rows of them."""

    def __init__(self, shape: tuple[int, ...], box: Box) -> None:
        shape, origin, sizes = (shape, box.origin, box.sizes) if shape else ((1,), (0,), (1,))
        k = len(shape) - 1
        while k > 0 and sizes[k] == shape[k]:
            k -= 1
        inner = math.prod(shape[k + 1 :])
        self.length = sizes[k] * inner
        self.count = math.prod(sizes[:k]) if self.length else 0
        self._lead = [(origin[d], sizes[d], math.prod(shape[d + 1 :])) for d in range(k)]
        self._base = origin[k] * inner

    def start(self, j: int) -> int:
        pos = self._base
        for origin, size, stride in reversed(self._lead):
            j, r = divmod(j, size)
            pos += (origin + r) * stride
        return pos

    def within(self, e0: int, e1: int) -> list[tuple[int, int, int]]:
        """(first element, end, element of the box's bytes) of the runs' parts in e0..e1."""
        lo, hi = 0, self.count
        while lo < hi:  # the first run that ends after e0 (runs start in increasing order)
            mid = (lo + hi) // 2
            if self.start(mid) + self.length <= e0:
                lo = mid + 1
            else:
                hi = mid
        out = []
        for j in range(lo, self.count):
            s = self.start(j)
            if s >= e1:
                break
            a, b = max(s, e0), min(s + self.length, e1)
            out.append((a, b, j * self.length + a - s))
        return out


class _Read(NamedTuple):
    source: str
    offset: int
    view: memoryview
    box: int  # whose checksum these bytes count for; -1: none


class Copier:
    """Writes ``tensors`` (in file order, at ``data_start + begin`` each) into ``sink``."""

    def __init__(self, tensors: list[OutTensor], begins: list[int], data_start: int, sink: Sink, cfg: Settings,
                 progress: Callable[[int], None] | None = None) -> None:
        self.tensors, self.sink, self.progress = tensors, sink, progress
        self.size = max(ALIGN, round_down(cfg.buffer_size, ALIGN))  # chunks cut between elements
        self.grid = sink.grid(self.size, cfg.direct_io)
        pieces = [Piece(None, data_start + b, 0, t.nbytes) for t, b in zip(tensors, begins, strict=True)]
        self.chunks = plan(pieces, self.size, self.grid)
        self.threads = max(1, min(cfg.io_threads, cfg.num_buffers, len(self.chunks)))
        self.boxes: list[Box] = []
        self.box_ids: list[list[int]] = []
        self.direct: list[bool] = []  # the tensor's one box is all of it, written unchanged: the output's CRC is its
        for t in tensors:
            self.box_ids.append(list(range(len(self.boxes), len(self.boxes) + len(t.boxes))))
            self.boxes += t.boxes
            self.direct.append(len(t.boxes) == 1 and not t.cast and t.boxes[0].sizes == t.shape)
        self.runs = [_Runs(t.shape, box) for t in tensors for box in t.boxes]
        self.tracked = [False] * len(self.boxes)  # boxes checksummed run by run
        for t_i, ids in enumerate(self.box_ids):
            for b in ids:
                self.tracked[b] = not self.direct[t_i] and self.boxes[b].crc is not None
        self.part_crcs: list[list[tuple[int, int, int]]] = [[] for _ in self.chunks]
        self.box_crcs: list[list[tuple[int, int, int]]] = [[] for _ in self.chunks]
        self.failure = Failure()
        self._claim, self._lock = iter(self.chunks), threading.Lock()
        self._sources: dict[str, Source] = {}

    def run(self) -> list[int]:
        """Move every byte; returns each tensor's CRC-32C as written (in file order)."""
        if not self.chunks:
            return [0] * len(self.tensors)
        cast = any(t.cast for t in self.tensors)
        buffers = POOL.acquire(self.size, self.threads * (2 if cast else 1), pinned=False)
        threads: list[threading.Thread] = []
        try:
            for path in dict.fromkeys(b.source for b in self.boxes):
                self._sources[path] = storage_for(path).open(path)
            with interrupts_deferred(self.failure.stop):
                for i in range(self.threads):
                    scratch = buffers[self.threads + i] if cast else None
                    threads.append(threading.Thread(target=self._thread, args=(buffers[i], scratch), daemon=True,
                                                    name=f"ckptstream-export-{i}"))
                    threads[-1].start()
                join(threads, self.failure.stop)
                self.failure.raise_first()
        finally:
            self.failure.stop()
            join(threads)
            POOL.release(buffers)
            for source in self._sources.values():
                source.close()
        self._check_sources()
        return _checksum.span_crcs(len(self.tensors), self.part_crcs)

    def _thread(self, buf: StagingBuffer, scratch: StagingBuffer | None) -> None:
        chunk = None
        try:
            while True:
                with self._lock:
                    chunk = None if self.failure.stopped else next(self._claim, None)
                if chunk is None:
                    return
                self._move(chunk, buf, scratch)
                if self.progress is not None:
                    with self._lock:
                        self.progress(chunk.stop - chunk.start)
        except BaseException as e:
            self.failure.record(e, chunk.index if chunk is not None else -1)

    def _move(self, chunk: Chunk, buf: StagingBuffer, scratch: StagingBuffer | None) -> None:
        crcs: list[tuple[int, int, int]] = []
        reads: list[_Read] = []
        for part in chunk.parts:
            t = self.tensors[part.piece]
            if t.cast:
                assert scratch is not None
                self._cast_part(part, buf, scratch, crcs)
            else:
                esz = t.dtype.itemsize
                dest = buf.view[part.at : part.at + part.hi - part.lo]
                e0, e1 = part.lo // esz, part.hi // esz
                reads += [_Read(s, o, dest[(a - e0) * esz : (b - e0) * esz], box)
                          for s, o, a, b, box in self._runs_in(part.piece, e0, e1)]
        self._read(reads, crcs)
        self.box_crcs[chunk.index] = crcs
        view = buf.view
        self.part_crcs[chunk.index] = [(p.piece, _checksum.crc_of(view[p.at : p.at + p.hi - p.lo]), p.hi - p.lo)
                                       for p in chunk.parts]
        self.sink.write_at(view[chunk.start - chunk.origin : chunk.stop - chunk.origin], chunk.start)

    def _cast_part(self, part: Part, buf: StagingBuffer, scratch: StagingBuffer,
                   crcs: list[tuple[int, int, int]]) -> None:
        """A part of a cast tensor: its source elements into the scratch buffer, window by
        window, each converted into the staging buffer."""
        t = self.tensors[part.piece]
        isz, osz = t.dtype.itemsize, t.out_dtype.itemsize
        e0, e1 = part.lo // osz, part.hi // osz
        step = scratch.size // isz
        for s0 in range(e0, e1, step):
            s1 = min(e1, s0 + step)
            src = scratch.view
            self._read([_Read(s, o, src[(a - s0) * isz : (b - s0) * isz], box)
                        for s, o, a, b, box in self._runs_in(part.piece, s0, s1)], crcs)
            out = buf.tensor[part.at + (s0 - e0) * osz : part.at + (s1 - e0) * osz].view(t.out_dtype)
            out.copy_(scratch.tensor[: (s1 - s0) * isz].view(t.dtype))

    def _runs_in(self, t_i: int, e0: int, e1: int) -> list[tuple[str, int, int, int, int]]:
        """(file, offset, first element, end, box) of the source runs that hold elements
        e0..e1 of tensor ``t_i``, in the tensor's order; they must tile e0..e1 exactly."""
        found = []
        esz = self.tensors[t_i].dtype.itemsize
        for b in self.box_ids[t_i]:
            box, runs = self.boxes[b], self.runs[b]
            found += [(box.source, box.offset + at * esz, a, z, b if self.tracked[b] else -1)
                      for a, z, at in runs.within(e0, e1)]
        if len(found) > 1:
            found.sort(key=lambda r: r[2])
        pos = e0
        for _, _, a, z, _ in found:
            if a != pos:
                self._not_tiled(t_i, "two chunks hold" if a < pos else "no chunk holds", min(a, pos))
            pos = z
        if pos != e1:
            self._not_tiled(t_i, "no chunk holds", pos)
        return found

    def _not_tiled(self, t_i: int, how: str, element: int) -> None:
        t = self.tensors[t_i]
        raise CorruptCheckpointError(f"{t.boxes[0].what}: {how} element {element} of {t.key!r} (shape "
                                     f"{list(t.shape)}): the chunks do not tile the tensor; the metadata is damaged")

    def _read(self, reads: list[_Read], crcs: list[tuple[int, int, int]]) -> None:
        """Read each run into its view: back-to-back runs of one file in one vectored read."""
        i = 0
        while i < len(reads):
            j, end = i + 1, reads[i].offset + len(reads[i].view)
            while j < len(reads) and reads[j].source == reads[i].source and reads[j].offset == end:
                end += len(reads[j].view)
                j += 1
            first = reads[i]
            got = self._sources[first.source].readv_into([r.view for r in reads[i:j]], first.offset)
            if got < end - first.offset:
                raise TruncatedFileError(first.source, first.offset, end - first.offset, got)
            crcs += [(r.box, _checksum.crc_of(r.view), len(r.view)) for r in reads[i:j] if r.box >= 0]
            i = j

    def _check_sources(self) -> None:
        """Compare each box's bytes with the CRC-32C its source stores (where one is)."""
        boxes = _checksum.span_crcs(len(self.boxes), self.box_crcs)
        out = _checksum.span_crcs(len(self.tensors), self.part_crcs)
        for t_i, ids in enumerate(self.box_ids):
            for b in ids:
                stored = self.boxes[b].crc
                computed = out[t_i] if self.direct[t_i] else boxes[b]
                if stored is not None and (self.direct[t_i] or self.tracked[b]) and computed != stored:
                    raise CorruptCheckpointError(
                        f"{self.boxes[b].what} fails its CRC-32C check (stored {stored:08x}, computed {computed:08x}): "
                        "the source's data is corrupt; restore it from another copy. Nothing was exported")
