"""Byte-grouping: the bytes of each value split into planes, so that an entropy coder sees the
low-entropy exponent bytes of floats together instead of interleaved with noisy mantissa bytes.

For a width of ``w`` bytes, plane ``j`` holds byte ``j`` of every element (little-endian: the
last plane holds the sign and the exponent's high bits). Torch ops only, so the transform runs
on whichever device holds the bytes; the planes are one new contiguous tensor.
"""

from __future__ import annotations

import torch

# dtypes whose element is several values: grouped by the width of one value, so that both halves
# of a complex number line up their exponents in the same planes
_VALUE_WIDTH = {torch.complex64: 4, torch.complex128: 8, torch.complex32: 2}


def value_width(dtype: torch.dtype) -> int:
    """The width in bytes that byte-grouping splits a ``dtype`` tensor's bytes by (1: no grouping)."""
    return _VALUE_WIDTH.get(dtype, torch.empty((), dtype=dtype).element_size())


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical (row-major) bytes of ``t`` as a 1-D uint8 tensor on its device (a view when
    ``t`` is contiguous; 0-d and empty tensors included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def group(data: torch.Tensor, width: int) -> torch.Tensor:
    """The planes of ``data`` (1-D uint8, a whole number of ``width``-byte elements)."""
    _check(data, width)
    if width == 1:
        return data.clone()
    return data.view(-1, width).t().contiguous().view(-1)


def ungroup(planes: torch.Tensor, width: int) -> torch.Tensor:
    """The bytes that ``group(data, width)`` made ``planes`` of: the inverse, bit for bit."""
    _check(planes, width)
    if width == 1:
        return planes.clone()
    return planes.view(width, -1).t().contiguous().view(-1)


def _check(data: torch.Tensor, width: int) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"byte-grouping takes a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    if width < 1 or data.numel() % width:
        raise ValueError(f"byte-grouping by {width} bytes needs a whole number of elements, got {data.numel()} bytes")


def chunk_bounds(nbytes: int, chunk_bytes: int, width: int) -> list[tuple[int, int]]:
    """The byte ranges of independent chunks of a tensor's ``nbytes``: ``chunk_bytes`` each, the
    last shorter. A chunk never cuts an element (each is grouped on its own)."""
    if chunk_bytes < 1 or chunk_bytes % width:
        raise ValueError(f"a chunk of {chunk_bytes} bytes would cut {width}-byte elements: "
                         f"use a multiple of {width}")
    return [(lo, min(lo + chunk_bytes, nbytes)) for lo in range(0, nbytes, chunk_bytes)]
