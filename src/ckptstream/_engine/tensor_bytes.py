"""Logical (row-major) bytes of any tensor, contiguous or not, in bounded pieces.

A contiguous tensor's bytes are a flat uint8 view of it: copies go straight to or from the
staging buffer. A non-contiguous tensor (a transpose, a strided slice, an expanded view) moves
through a small temporary on its own device, one chunk's worth of whole elements at a time, so
no full-size copy is ever made. Chunk edges may cut an element in two; on load the leading bytes
of the cut element wait in a per-tensor ``carry`` until the next chunk completes it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import torch

from .._errors import UnsupportedTypeError

# torch 2.8 has no copy kernel for float4_e2m1fn_x2 (2.12 has): its tensors are copied as the
# uint8 views of their bytes, one byte an element as well
BYTE_COPIED = frozenset(d for d in [getattr(torch, "float4_e2m1fn_x2", None)] if d is not None)


# the tensor types whose layout, strides and data_ptr() are their own memory's (a subclass may
# override them, or wrap another tensor): only these are stored, and take the short ways
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def copyable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the uint8 view of its bytes where its dtype may have no copy kernel."""
    return t.view(torch.uint8) if t.dtype in BYTE_COPIED else t


def streamable(t: torch.Tensor) -> bool:
    """Whether the engine can move ``t``'s bytes: a dense (strided) CPU or CUDA tensor."""
    return t.layout == torch.strided and t.device.type in ("cpu", "cuda") and not t.is_quantized


def check_tensor(t: object, name: str, writable: bool = False) -> torch.Tensor:
    """``t`` if the engine can move it (and, ``writable``, read into it); raises otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not streamable(t):
        what = "quantized" if t.is_quantized else f"{t.layout}"
        raise UnsupportedTypeError(f"{name} is a {what} tensor on {t.device}; "
                                   "only dense (strided) CPU and CUDA tensors can be streamed")
    if t.is_conj() or t.is_neg():
        # a lazy conjugate/negative view: its memory holds other values than it shows
        raise UnsupportedTypeError(f"{name} is a lazy conjugate or negative view; "
                                   f"pass {name}.resolve_conj().resolve_neg() (a copy) instead")
    if writable and any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is an expanded view whose elements share "
            "memory, so it cannot hold distinct values; read into a tensor that owns its elements"
        )
    return t


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, also for shapes without elements whose contiguous strides would overflow."""
    if 0 in shape:
        return torch.empty(0, dtype=dtype, device=device).as_strided(shape, [1] * len(shape))
    return torch.empty(shape, dtype=dtype, device=device)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's bytes (no copy). A 1-d tensor with unit stride (the
    many small biases and norms) takes one view; any other goes through ``as_strided``, as a
    contiguous tensor's dimensions of size 1 may have any stride, which a dtype view refuses."""
    if t.dim() == 1 and t.stride(0) == 1:
        return t.view(torch.uint8)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous host tensor's bytes (no copy); the tensor must
    outlive it."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def row_major_blocks(t: torch.Tensor, e0: int, e1: int) -> Iterator[torch.Tensor]:
    """Rectangular sub-views of ``t`` that together hold its elements e0..e1 in row-major order."""
    if e0 >= e1:
        return
    if t.is_contiguous():
        yield t.reshape(-1)[e0:e1]
        return
    row = t.numel() // t.shape[0]
    first_full, end_full = -(-e0 // row), e1 // row
    if first_full > end_full:  # the range lies inside one row
        r = e0 // row
        yield from row_major_blocks(t[r], e0 - r * row, e1 - r * row)
        return
    if e0 % row:
        r = e0 // row
        yield from row_major_blocks(t[r], e0 - r * row, row)
    if end_full > first_full:
        yield t[first_full:end_full]
    if e1 % row:
        yield from row_major_blocks(t[end_full], 0, e1 - end_full * row)


def _gather(t: torch.Tensor, e0: int, e1: int, out: torch.Tensor) -> None:
    """Copy ``t``'s elements e0..e1 (row-major) into the 1-d tensor ``out``."""
    pos = 0
    for block in row_major_blocks(t, e0, e1):
        out[pos : pos + block.numel()].view(block.shape).copy_(block)
        pos += block.numel()


def _scatter(src: torch.Tensor, t: torch.Tensor, e0: int, e1: int) -> None:
    """Copy the 1-d tensor ``src`` into ``t``'s elements e0..e1 (row-major)."""
    pos = 0
    for block in row_major_blocks(t, e0, e1):
        block.copy_(src[pos : pos + block.numel()].view(block.shape))
        pos += block.numel()


def _in_place(t: torch.Tensor, staged: torch.Tensor, lo: int, hi: int) -> tuple[int, int] | None:
    """The whole elements w0..w1 of ``t``'s bytes lo..hi, where the staging bytes can hold them
    as ``t``'s dtype in place (same device, aligned); None where they cannot."""
    esz = t.element_size()
    w0, w1 = -(-lo // esz), hi // esz
    if t.device != staged.device or w0 > w1 or (staged.storage_offset() + w0 * esz - lo) % esz:
        return None
    return w0, w1


def copy_out(t: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
    """Copy logical bytes lo..hi of ``t`` into the uint8 tensor ``dst`` (asynchronously on CUDA).

    A host tensor's whole elements go straight into ``dst``; elements cut by lo or hi, and a
    device tensor's bytes, through a temporary of the range's size on its device.
    """
    t = copyable(t)
    if t.is_contiguous():
        dst.copy_(flat_bytes(t)[lo:hi], non_blocking=True)
        return
    esz = t.element_size()
    e0, e1 = lo // esz, -(-hi // esz)
    whole = _in_place(t, dst, lo, hi)
    if whole is None:
        tmp = torch.empty(e1 - e0, dtype=t.dtype, device=t.device)
        _gather(t, e0, e1, tmp)
        dst.copy_(tmp.view(torch.uint8)[lo - e0 * esz : hi - e0 * esz], non_blocking=True)
        return
    w0, w1 = whole
    _gather(t, w0, w1, dst[w0 * esz - lo : w1 * esz - lo].view(t.dtype))
    for cut in [e0] * (lo % esz > 0) + [e1 - 1] * (hi % esz > 0):  # elements only partly in lo..hi
        one = torch.empty(1, dtype=t.dtype)
        _gather(t, cut, cut + 1, one)
        a, b = max(lo, cut * esz), min(hi, (cut + 1) * esz)
        dst[a - lo : b - lo].copy_(one.view(torch.uint8)[a - cut * esz : b - cut * esz])


def copy_in(src: torch.Tensor, t: torch.Tensor, lo: int, hi: int, carry: torch.Tensor | None) -> None:
    """Copy the uint8 tensor ``src`` into logical bytes lo..hi of ``t``.

    For a non-contiguous ``t`` the pieces of one tensor must arrive in order, with the same
    ``carry`` (a uint8 tensor of one element's size on t's device), which holds the leading
    bytes of an element cut by a piece's end until the next piece completes it. A host tensor's
    whole elements come straight from ``src``; a device tensor's through a temporary.
    """
    t = copyable(t)
    if t.is_contiguous():
        flat_bytes(t)[lo:hi].copy_(src, non_blocking=True)
        return
    assert carry is not None
    esz = t.element_size()
    whole = _in_place(t, src, lo, hi)
    if whole is None:
        _copy_in_through(src, t, lo, hi, carry)
        return
    w0, w1 = whole
    head, tail = w0 * esz - lo, hi - w1 * esz
    if head:  # completes the element before w0, whose first bytes wait in the carry
        carry[esz - head :].copy_(src[:head])
        _scatter(carry.view(t.dtype), t, w0 - 1, w0)
    _scatter(src[head : head + (w1 - w0) * esz].view(t.dtype), t, w0, w1)
    if tail:
        carry[:tail].copy_(src[hi - lo - tail :])


def _copy_in_through(src: torch.Tensor, t: torch.Tensor, lo: int, hi: int, carry: torch.Tensor) -> None:
    """copy_in through a temporary of the range's size on t's device."""
    esz = t.element_size()
    e0, e1 = lo // esz, -(-hi // esz)
    tmp = torch.empty((e1 - e0) * esz, dtype=torch.uint8, device=t.device)
    head = lo - e0 * esz
    if head:
        tmp[:head].copy_(carry[:head])
    tmp[head : head + hi - lo].copy_(src, non_blocking=True)
    complete = hi // esz  # elements before this index are whole now
    _scatter(tmp.view(t.dtype), t, e0, complete)
    tail = hi - complete * esz
    if tail:
        carry[:tail].copy_(tmp[(complete - e0) * esz : hi - e0 * esz])
