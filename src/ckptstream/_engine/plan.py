"""What a transfer moves and in which chunks: pieces (a tensor's bytes at a file offset) cut into
chunks of one staging buffer each.

Chunks lie on the grid the storage target asks for (``Target.grid``: a local file's block size
under O_DIRECT, an object store's part size), so that every chunk but the first of a run starts
on a multiple of it. Many small pieces share one chunk; one large piece spans many. Stretches of
the file that no piece needs are skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._storage import round_down


class Piece(NamedTuple):
    """Bytes ``lo``..``hi`` of a tensor's logical (row-major) bytes, at file offset ``offset``.

    ``tensor`` None stands for ``hi - lo`` bytes of the file that are only read (to checksum
    them). A piece of a non-contiguous tensor starts and ends on element boundaries.
    """

    tensor: torch.Tensor | None
    offset: int
    lo: int
    hi: int

    @classmethod
    def of(cls, tensor: torch.Tensor, offset: int) -> Piece:
        """All of ``tensor``'s bytes at ``offset``."""
        return cls(tensor, offset, 0, tensor.nbytes)  # the logical bytes, contiguous or not

    @classmethod
    def unread(cls, nbytes: int, offset: int) -> Piece:
        """``nbytes`` of the file at ``offset``, read for their checksum only."""
        return cls(None, offset, 0, nbytes)

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    @property
    def end(self) -> int:
        """The file offset after the piece."""
        return self.offset + self.hi - self.lo


@dataclasses.dataclass(slots=True)
class Part:
    """The bytes of one piece that one chunk moves."""

    piece: int  # index into the transfer's pieces
    lo: int  # byte range of the piece's tensor
    hi: int
    at: int  # where those bytes sit in the staging buffer


@dataclasses.dataclass(slots=True)
class Chunk:
    index: int
    start: int  # file bytes the chunk moves
    stop: int
    origin: int  # the file offset that the staging buffer's byte 0 stands for (aligned)
    parts: list[Part]


def check_pieces(pieces: Sequence[Piece], *, writing: bool) -> None:
    """Raise ValueError for pieces the engines cannot move."""
    for i, (t, offset, lo, hi) in enumerate(pieces):
        if offset < 0 or not 0 <= lo <= hi:
            raise ValueError(f"piece {i}: offset {offset} and byte range {lo}..{hi} must be non-negative and ordered")
        if t is None or (lo == 0 and hi == t.nbytes and t.is_contiguous()):
            continue  # the common case: a whole contiguous tensor
        size = t.nbytes
        if hi > size:
            raise ValueError(f"piece {i}: byte range {lo}..{hi} runs past the tensor's {size} bytes")
        if not t.is_contiguous() and (lo % t.element_size() or hi % t.element_size()):
            raise ValueError(f"piece {i}: a non-contiguous tensor's byte range must cut at whole elements")
    if writing:  # a write leaves no hole of stale staging bytes, nor writes a byte twice
        moved = [p for p in pieces if p.hi > p.lo]
        for i, (a, b) in enumerate(itertools.pairwise(moved)):
            if b.offset != a.end:
                raise ValueError(f"a write's pieces lie back to back in file order: piece {i + 1} of those with "
                                 f"bytes starts at {b.offset}, expected {a.end}")


def plan(pieces: Sequence[Piece], buffer_size: int, align: int) -> list[Chunk]:
    """The chunks that move ``pieces``, in file order (pieces sorted by offset; reads may
    overlap). A chunk covers at most ``buffer_size`` bytes from its origin, a multiple of
    ``align`` (the target's grid). (Written for speed: a state may hold hundreds of thousands
    of small tensors.)"""
    offsets = [p[1] for p in pieces]
    chunks: list[Chunk] = []
    last = Chunk(-1, 0, 0, -1, [])
    window_end = -1  # the end of the last chunk's window
    for i in sorted(range(len(pieces)), key=offsets.__getitem__):
        _, offset, lo, hi = pieces[i]
        pos, end = offset, offset + hi - lo
        while pos < end:
            if not last.origin <= pos < window_end:
                last = Chunk(len(chunks), pos, pos, round_down(pos, align), [])
                window_end = last.origin + buffer_size
                chunks.append(last)
            stop = end if end <= window_end else window_end
            last.parts.append(Part(i, lo + pos - offset, lo + stop - offset, pos - last.origin))
            if pos < last.start:
                last.start = pos
            if stop > last.stop:
                last.stop = stop
            pos = stop
    return chunks
