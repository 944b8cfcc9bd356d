"""The public primitive: one tensor to or from a file, streamed through staging buffers."""

from __future__ import annotations

import torch

from . import _fileio
from ._errors import UnsupportedTypeError
from ._layout import streamable
from ._pipeline import Span, read_spans, write_spans
from ._settings import resolve
from ._streams import check_stream


def _check_tensor(t: object, name: str, writable: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not streamable(t):
        raise UnsupportedTypeError(
            f"{name} is a {t.layout} tensor on {t.device}{' (quantized)' if t.is_quantized else ''}; "
            "only dense (strided) CPU and CUDA tensors can be streamed"
        )
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


def device_to_file(src: torch.Tensor, file: _fileio.FileLike, *, offset: int | None = None,
                   buffer_size: int | None = None, num_buffers: int | None = None,
                   stream: torch.cuda.Stream | None = None) -> int:
    """Write the bytes of ``src`` to ``file`` through a few staging buffers.

    Args:
        src: a CPU or CUDA tensor of any dtype, contiguous or not; its logical row-major bytes
            (what ``src.contiguous()`` holds) are written, without a full-size host copy.
        file: a path (created or truncated when ``offset`` is None, then fsynced), an int file
            descriptor, or a binary file object with ``fileno()``.
        offset: None writes at the file's current position and advances it (successive calls
            append); an int writes at that offset and leaves the position alone.
        buffer_size, num_buffers: staging buffers for this call (default: ``ckptstream.settings``).
        stream: the CUDA stream whose queued work produces ``src`` (default: the current stream).

    Returns:
        The number of bytes written (``src.numel() * src.element_size()``).

    Raises:
        OSError: from the OS (ENOSPC, EFBIG, EIO, ...), with the path in the message.
        ValueError: ``buffer_size`` or ``num_buffers`` below 1.

    Example:
        >>> with open("state.bin", "wb") as f:
        ...     ckptstream.device_to_file(m, f)
        ...     ckptstream.device_to_file(v, f)
    """
    cfg = resolve(buffer_size=buffer_size, num_buffers=num_buffers)
    _check_tensor(src, "src")
    check_stream(stream)  # every argument is checked before the file is opened (and truncated)
    with _fileio.endpoint(file, offset, writing=True) as ep:
        span = Span.of(src, ep.start)
        write_spans(ep, [span], cfg, stream=stream)
        if ep.owned:
            _fileio.fsync(ep.fd, ep.path)
    _fileio.advance_position(file, offset, ep.start + span.nbytes)
    return span.nbytes


def file_to_device(file: _fileio.FileLike, dst: torch.Tensor, *, offset: int | None = None,
                   buffer_size: int | None = None, num_buffers: int | None = None,
                   stream: torch.cuda.Stream | None = None) -> int:
    """Fill ``dst`` in place with ``dst.nbytes`` bytes of ``file``.

    Args:
        file: a path (read from offset 0 when ``offset`` is None), an int file descriptor, or a
            binary file object with ``fileno()``.
        dst: a CPU or CUDA tensor of any dtype, contiguous or not (filled in row-major order).
        offset: None reads at the file's current position and advances it; an int reads there.
        buffer_size, num_buffers: staging buffers for this call (default: ``ckptstream.settings``).
        stream: the CUDA stream whose later work uses ``dst`` (default: the current stream).

    Returns:
        The number of bytes read (always ``dst.numel() * dst.element_size()``).

    Raises:
        TruncatedFileError: the file holds fewer bytes than ``dst`` needs (checked before any
            byte of ``dst`` is written, where the file's size is known).
        ValueError: ``dst`` is an expanded view (stride 0), or ``buffer_size`` or ``num_buffers``
            below 1.
        OSError: from the OS, with the path in the message.

    Example:
        >>> ckptstream.file_to_device("weights.bin", torch.empty(n, device="cuda"))
    """
    cfg = resolve(buffer_size=buffer_size, num_buffers=num_buffers)
    _check_tensor(dst, "dst", writable=True)
    check_stream(stream)
    with _fileio.endpoint(file, offset, writing=False) as ep:
        span = Span.of(dst, ep.start)
        _fileio.check_length(ep.fd, ep.path, ep.start, span.nbytes)
        read_spans(ep, [span], cfg, stream=stream)
    _fileio.advance_position(file, offset, ep.start + span.nbytes)
    return span.nbytes
