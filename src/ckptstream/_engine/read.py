"""The read engine: file -> tensors.

Per chunk, on the I/O thread that claimed it: wait until the staging buffer's previous
host-to-device copies are done -> pread the chunk -> enqueue the copies into the tensors (side
streams) -> record events (the buffer is free again once they complete) -> checksum the buffer
while the device copies it. Loads into CUDA tensors checksum large contiguous tensors on the
device instead, once every copy is queued (see gpucrc).

Copies into non-contiguous tensors take turns in file order across the threads: an element cut
by a chunk's end waits in a carry until the next chunk completes it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from .. import _fileio
from .._errors import TruncatedFileError
from .._settings import ALIGN
from .buffers import StagingBuffer
from .control import Failure, Stopped
from .engine import Engine
from .layout import copy_in
from .plan import Chunk


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class ReadEngine(Engine):
    """Fills each piece's tensor bytes from its file offset (pieces may overlap)."""

    writing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, list[Any]] = {}  # per staging buffer: the events of its copies
        self._carries: dict[int, torch.Tensor] = {}  # per non-contiguous piece
        self._turns = _Turns([c.index for c in self.chunks if self._has_ordered(c)], self.failure)
        # pieces checksummed on their device once loaded, not from the staging buffers
        self.on_device = [self.checksum and flat is not None and self.streams.checksums_on_device(flat[p.lo : p.hi])
                          for p, flat in zip(self.pieces, self.flat, strict=True)]

    def _has_ordered(self, chunk: Chunk) -> bool:
        return any(self.pieces[p.piece].tensor is not None and self.flat[p.piece] is None for p in chunk.parts)

    def _move(self, chunk: Chunk, buf: StagingBuffer) -> None:
        for event in self._pending.get(id(buf), ()):
            event.synchronize()  # the buffer's previous copies are done: it may be refilled
        self._read(chunk, buf)
        events = self._copy_parts(chunk, buf, ordered=False)
        if self._turns.wait(chunk.index):
            events += self._copy_parts(chunk, buf, ordered=True)
            self._turns.done()
        self._pending[id(buf)] = events
        if self.checksum:  # while the device copies
            self.host_crcs(chunk, buf, self.on_device)

    def _copy_parts(self, chunk: Chunk, buf: StagingBuffer, *, ordered: bool) -> list[Any]:
        """Enqueue the copies of the chunk's parts into contiguous tensors (or, ``ordered``,
        into non-contiguous ones); returns events that mark their end."""
        devices = set()
        for part in chunk.parts:
            t, flat = self.pieces[part.piece].tensor, self.flat[part.piece]
            if t is None or (flat is None) != ordered:
                continue
            staged = self.staged(buf, part)
            if flat is not None:
                self.streams.enqueue(partial(_copy, flat[part.lo : part.hi], staged))
            else:
                self.streams.enqueue(partial(copy_in, staged, t, part.lo, part.hi, self._carry(part.piece, t)))
            devices.add(self.device[part.piece])
        return self.streams.record(d for d in devices if d is not None)

    def _carry(self, piece: int, t: torch.Tensor) -> torch.Tensor:
        if piece not in self._carries:
            self._carries[piece] = torch.empty(t.element_size(), dtype=torch.uint8, device=t.device)
        return self._carries[piece]

    def _read(self, chunk: Chunk, buf: StagingBuffer) -> None:
        """pread one chunk in one call (from a hot page cache, small reads run at a fraction of
        the speed of whole-buffer ones)."""
        path, origin = self.file.path, chunk.origin
        if self.direct_fd is not None:  # whole aligned blocks; bytes beyond the chunk are ignored
            lo, hi = _fileio.round_down(chunk.start, ALIGN), _fileio.round_up(chunk.stop, ALIGN)
            got = _fileio.pread_into(self.direct_fd, buf.view[lo - origin : hi - origin], lo, path)
        else:
            lo = chunk.start
            got = _fileio.pread_into(self.file.fd, buf.view[lo - origin : chunk.stop - origin], lo, path)
        if lo + got < chunk.stop:  # the file ends at lo + got: report it for the whole read
            begin, end = self.chunks[0].start, max(c.stop for c in self.chunks)
            raise TruncatedFileError(path, begin, end - begin, max(0, lo + got - begin))

    def _result(self) -> list[int]:
        values = super()._result()
        if any(self.on_device):
            with self.streams.copying():  # queued after the copies
                for picked in self._on_device_by_device().values():
                    flats = [self.flat[i][self.pieces[i].lo : self.pieces[i].hi] for i in picked]  # type: ignore[index]
                    for i, crc in zip(picked, self.streams.checksums(flats), strict=True):
                        values[i] = crc
        self.streams.hand_back()
        return values

    def _on_device_by_device(self) -> dict[Any, list[int]]:
        out: dict[Any, list[int]] = {}
        for i, picked in enumerate(self.on_device):
            if picked:
                out.setdefault(self.device[i], []).append(i)
        return out


class _Turns:
    """File order for the copies into non-contiguous tensors, across the I/O threads.

    Threads claim chunks in file order, so the thread whose turn it is never waits for a later
    one; a thread waiting for its turn stops when the transfer fails elsewhere.
    """

    def __init__(self, ordered: Sequence[int], failure: Failure) -> None:
        self._ordered, self._next = set(ordered), iter(sorted(ordered))
        self._turn = next(self._next, None)
        self._cv = threading.Condition()
        self._failure = failure

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
