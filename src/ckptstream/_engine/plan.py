"""What a transfer moves and in which chunks: pieces (a tensor's bytes at a file offset) cut into
chunks of one staging buffer each.

Chunks lie on a grid aligned to the file system's block size, so that every chunk but the first
of a run starts on an aligned file offset (O_DIRECT). Many small pieces share one chunk; one
large piece spans many. Stretches of the file that no piece needs are skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from .._fileio import round_down


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
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
        return cls(tensor, offset, 0, tensor.numel() * tensor.element_size())

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
    for i, p in enumerate(pieces):
        if p.offset < 0 or not 0 <= p.lo <= p.hi:
            raise ValueError(f"piece {i}: offset {p.offset} and byte range {p.lo}..{p.hi} must be non-negative and ordered")
        t = p.tensor
        if t is not None:
            size = t.numel() * t.element_size()
            if p.hi > size:
                raise ValueError(f"piece {i}: byte range {p.lo}..{p.hi} runs past the tensor's {size} bytes")
            if not t.is_contiguous() and (p.lo % t.element_size() or p.hi % t.element_size()):
                raise ValueError(f"piece {i}: a non-contiguous tensor's byte range must cut at whole elements")
    if writing:  # a write leaves no hole of stale staging bytes, nor writes a byte twice
        moved = [p for p in pieces if p.nbytes]
        for i, (a, b) in enumerate(itertools.pairwise(moved)):
            if b.offset != a.end:
                raise ValueError(f"a write's pieces lie back to back in file order: piece {i + 1} of those with "
                                 f"bytes starts at {b.offset}, expected {a.end}")


def plan(pieces: Sequence[Piece], buffer_size: int, align: int) -> list[Chunk]:
    """The chunks that move ``pieces``, in file order (pieces sorted by offset; reads may
    overlap). A chunk covers at most ``buffer_size`` bytes from its aligned origin."""
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].offset)
    chunks: list[Chunk] = []
    for i in order:
        p = pieces[i]
        pos = p.offset
        while pos < p.end:
            last = chunks[-1] if chunks else None
            if last is None or not last.origin <= pos < last.origin + buffer_size:
                last = Chunk(len(chunks), pos, pos, round_down(pos, align), [])
                chunks.append(last)
            stop = min(p.end, last.origin + buffer_size)
            last.parts.append(Part(i, p.lo + pos - p.offset, p.lo + stop - p.offset, pos - last.origin))
            last.start, last.stop = min(last.start, pos), max(last.stop, stop)
            pos = stop
    return chunks
