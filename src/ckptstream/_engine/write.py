"""The write engine: tensors -> file.

Per chunk, on the I/O thread that claimed it: enqueue the device-to-host copies of the chunk's
bytes into one of the thread's staging buffers (on the side streams) -> record events -> wait
for them (the buffer holds the chunk only once the copies are done) -> checksum -> write it at
its offset of the sink.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import _checksum
from .._storage import Sink
from .buffers import StagingBuffer
from .engine import BATCH, Engine
from .plan import Chunk, Part
from .tensor_bytes import copy_out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _gather(flats: list[torch.Tensor], staged: torch.Tensor) -> None:
    """Many small device tensors' bytes to the staging buffer: gathered on the device, then
    one copy (instead of one copy, and its launch, each)."""
    scratch = torch.empty(staged.numel(), dtype=torch.uint8, device=flats[0].device)
    torch.cat(flats, out=scratch)
    staged.copy_(scratch, non_blocking=True)


class WriteEngine(Engine[Sink]):
    """Writes each piece's tensor bytes at its file offset (pieces back to back)."""

    writing = True

    def _move(self, chunk: Chunk, buf: StagingBuffer | None) -> None:
        assert buf is not None
        devices, view = set(), buf.view
        for kind, parts in self.segments(chunk):
            part = parts[0]
            i = part.piece
            if kind == "host":  # immediate: host memory to host memory
                view[part.at : part.at + part.hi - part.lo] = self.host[i][part.lo : part.hi]  # type: ignore[index]
                continue
            devices.add(self.device[i])
            if kind == "strided":
                t = self.pieces[i].tensor
                assert t is not None
                self.streams.enqueue(partial(copy_out, t, part.lo, part.hi, self.staged(buf, part)))
            elif len(parts) >= BATCH:
                end = parts[-1].at + parts[-1].hi - parts[-1].lo
                flats = [self._bytes(p) for p in parts]
                self.streams.enqueue(partial(_gather, flats, buf.tensor[part.at : end]))
            else:
                for p in parts:
                    self.streams.enqueue(partial(_copy, self.staged(buf, p), self._bytes(p)))
        for event in self.streams.record(d for d in devices if d is not None):
            event.synchronize()  # the buffer holds the chunk only once its copies are done
        if self.checksum:
            view = buf.view  # the CRC-32C of each of the chunk's parts
            self.part_crcs[chunk.index] = [(p.piece, _checksum.crc_of(view[p.at : p.at + p.hi - p.lo]), p.hi - p.lo)
                                           for p in chunk.parts]
        self._write(chunk, buf)

    def _bytes(self, part: Part) -> torch.Tensor:
        """The part's bytes of its device piece: the flat view itself where the part is all of
        it (small tensors: a slice costs more than their bytes' copy)."""
        flat = self.flat[part.piece]
        assert flat is not None
        return flat if part.lo == 0 and part.hi == len(flat) else flat[part.lo : part.hi]

    def _write(self, chunk: Chunk, buf: StagingBuffer) -> None:
        """Write one chunk: its bytes sit in the buffer from where its origin (on the sink's
        grid) does, so a slice of the buffer lies on the grid like its offset."""
        lo, origin = chunk.start, chunk.origin
        self.file.write_at(buf.view[lo - origin : chunk.stop - origin], lo)
