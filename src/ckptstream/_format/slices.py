"""A box of a stored tensor (offsets and lengths per dimension) as the file's byte runs.

A tensor is stored row-major, so a box is contiguous in the file from the first dimension on
whose trailing dimensions it spans whole: a box of rows is one run, a box of columns one run per
row. Each run becomes one piece of the read, landing in the matching sub-view of the
destination (contiguous or not).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from .._engine import Piece


def normalize_box(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int] | None,
                  key: str) -> tuple[list[int], list[int]]:
    """Offsets and lengths for every dimension, checked to lie inside ``shape``; raises
    IndexError naming the key. A dimension without an offset starts at 0, one without a length
    runs to its end (``lengths`` None: every dimension does)."""
    offsets = [int(o) for o in offsets]
    lengths = [] if lengths is None else [int(n) for n in lengths]
    offsets += [0] * (len(shape) - len(offsets))
    # a dimension without a length runs from its offset to its end
    lengths += [shape[i] - offsets[i] for i in range(len(lengths), len(shape))]
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        raise IndexError(f"{key}: a slice of a tensor of shape {list(shape)} takes at most {len(shape)} offsets "
                         f"and lengths, got {len(offsets)} and {len(lengths)}")
    for dim, (size, o, n) in enumerate(zip(shape, offsets, lengths, strict=True)):
        if o < 0 or n < 0 or o + n > size:
            raise IndexError(f"{key}: dimension {dim} of size {size} has no elements {o}..{o + n}; "
                             "offsets and lengths must lie inside the shape")
    return offsets, lengths


def slice_pieces(into: torch.Tensor, shape: Sequence[int], offsets: Sequence[int], offset: int) -> list[Piece]:
    """Pieces that read the box of a row-major tensor of ``shape`` stored at file ``offset``,
    starting at ``offsets`` and as large as ``into`` (the destination), into ``into``."""
    lengths = list(into.shape)
    esz = into.element_size()
    if into.numel() == 0:
        return []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # the first dimension from which the box is one run: all later ones are whole
    split = len(shape) - 1
    while split > 0 and lengths[split] == shape[split]:
        split -= 1
    pieces = []
    for index in itertools.product(*(range(n) for n in lengths[:split])):
        element = sum((offsets[d] + i) * strides[d] for d, i in enumerate(index))
        element += offsets[split] * strides[split] if shape else 0
        dst = into[index] if index else into
        pieces.append(Piece.of(dst, offset + element * esz))
    return pieces
