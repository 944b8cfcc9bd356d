"""The write engine: tensors -> file.

Per chunk, on the I/O thread that claimed it: enqueue the device-to-host copies of the chunk's
bytes into one of the thread's staging buffers (on the side streams) -> record events -> wait
for them (the buffer holds the chunk only once the copies are done) -> checksum -> pwrite.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import _fileio
from .._settings import ALIGN
from .buffers import StagingBuffer
from .engine import Engine
from .layout import copy_out
from .plan import Chunk


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class WriteEngine(Engine):
    """Writes each piece's tensor bytes at its file offset (pieces back to back)."""

    writing = True

    def _move(self, chunk: Chunk, buf: StagingBuffer) -> None:
        devices = set()
        for part in chunk.parts:
            t = self.pieces[part.piece].tensor
            if t is None:
                continue
            flat, staged = self.flat[part.piece], self.staged(buf, part)
            if flat is not None:
                self.streams.enqueue(partial(_copy, staged, flat[part.lo : part.hi]))
            else:
                self.streams.enqueue(partial(copy_out, t, part.lo, part.hi, staged))
            devices.add(self.device[part.piece])
        for event in self.streams.record(d for d in devices if d is not None):
            event.synchronize()
        if self.checksum:
            self.host_crcs(chunk, buf)
        self._write(chunk, buf)

    def _write(self, chunk: Chunk, buf: StagingBuffer) -> None:
        """pwrite one chunk; with O_DIRECT the aligned middle goes direct, unaligned edges
        buffered (padding the edges instead would overwrite bytes that follow in an existing
        file)."""
        path, lo, hi, origin = self.file.path, chunk.start, chunk.stop, chunk.origin
        if self.direct_fd is not None:
            a_lo, a_hi = _fileio.round_up(lo, ALIGN), _fileio.round_down(hi, ALIGN)
            if a_lo < a_hi:
                _fileio.pwrite_all(self.direct_fd, buf.view[a_lo - origin : a_hi - origin], a_lo, path)
                _fileio.pwrite_all(self.file.fd, buf.view[lo - origin : a_lo - origin], lo, path)
                _fileio.pwrite_all(self.file.fd, buf.view[a_hi - origin : hi - origin], a_hi, path)
                return
        _fileio.pwrite_all(self.file.fd, buf.view[lo - origin : hi - origin], lo, path)
