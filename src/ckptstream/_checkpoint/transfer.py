"""The public primitive: one tensor to or from a file, streamed through staging buffers.

By nature a local-file API (it takes int descriptors and file objects, and writes in place at
any offset): it opens its files through the local storage's own entry point
(``_storage.local.opened``), whose sinks and sources the engines take like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._engine import Piece, ReadEngine, WriteEngine, check_stream, check_tensor
from .._settings import LegacyKeywords, Settings, per_call
from .._storage.files import FileSink, FileSource
from .._storage.local import FileLike, advance_position, opened

if TYPE_CHECKING:
    from typing_extensions import Unpack


def device_to_file(src: torch.Tensor, file: FileLike, *, offset: int | None = None,
                   stream: torch.cuda.Stream | None = None, settings: Settings | None = None,
                   **legacy: Unpack[LegacyKeywords]) -> int:
    """Write the bytes of ``src`` to ``file`` (a local file: this primitive writes in place, at
    any offset) through a few staging buffers.

    Args:
        src: a CPU or CUDA tensor of any dtype, contiguous or not; its logical row-major bytes
            (what ``src.contiguous()`` holds) are written, without a full-size host copy.
        file: a path (created or truncated when ``offset`` is None, then fsynced), an int file
            descriptor, or a binary file object with ``fileno()``.
        offset: None writes at the file's current position and advances it (successive calls
            append); an int writes at that offset and leaves the position alone.
        stream: the CUDA stream whose queued work produces ``src`` (default: the current stream).
        settings: the ``Settings`` of this call (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=4 << 20)``); None: those in force. 0.1.0's per-call
            ``buffer_size`` and ``num_buffers`` are deprecated in its favour.

    Returns:
        The number of bytes written (``src.numel() * src.element_size()``).

    Raises:
        OSError: from the OS (ENOSPC, EFBIG, EIO, ...), with the path in the message.
        ValueError: a setting out of range.

    Example:
        >>> with open("state.bin", "wb") as f:
        ...     ckptstream.device_to_file(m, f)
        ...     ckptstream.device_to_file(v, f)
    """
    cfg = per_call("device_to_file", settings, legacy)
    check_tensor(src, "src")
    check_stream(stream)  # every argument is checked before the file is opened (and truncated)
    with opened(file, offset, FileSink) as (sink, start):
        piece = Piece.of(src, start)
        WriteEngine(sink, [piece], cfg, stream=stream).run()
        sink.publish()  # fsync, where the path was opened here
    advance_position(file, offset, piece.end)
    return piece.nbytes


def file_to_device(file: FileLike, dst: torch.Tensor, *, offset: int | None = None,
                   stream: torch.cuda.Stream | None = None, settings: Settings | None = None,
                   **legacy: Unpack[LegacyKeywords]) -> int:
    """Fill ``dst`` in place with ``dst.nbytes`` bytes of ``file`` (a local file).

    Args:
        file: a path (read from offset 0 when ``offset`` is None), an int file descriptor, or a
            binary file object with ``fileno()``.
        dst: a CPU or CUDA tensor of any dtype, contiguous or not (filled in row-major order).
        offset: None reads at the file's current position and advances it; an int reads there.
        stream: the CUDA stream whose later work uses ``dst`` (default: the current stream).
        settings: the ``Settings`` of this call (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=4 << 20)``); None: those in force. 0.1.0's per-call
            ``buffer_size`` and ``num_buffers`` are deprecated in its favour.

    Returns:
        The number of bytes read (always ``dst.numel() * dst.element_size()``).

    Raises:
        TruncatedFileError: the file holds fewer bytes than ``dst`` needs (checked before any
            byte of ``dst`` is written, where the file's size is known).
        ValueError: ``dst`` is an expanded view (stride 0), or a setting out of range.
        OSError: from the OS, with the path in the message.

    Example:
        >>> ckptstream.file_to_device("weights.bin", torch.empty(n, device="cuda"))
    """
    cfg = per_call("file_to_device", settings, legacy)
    check_tensor(dst, "dst", writable=True)
    check_stream(stream)
    with opened(file, offset, FileSource) as (source, start):
        piece = Piece.of(dst, start)
        source.check_length(start, piece.nbytes)
        ReadEngine(source, [piece], cfg, stream=stream).run()
    advance_position(file, offset, piece.end)
    return piece.nbytes
