"""Loading: ``open`` (the lazy reader), ``load``, ``verify`` and ``read_metadata``, thin users of
``CheckpointReader``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .. import _gc
from .._engine import gpucrc
from .._errors import ObjectReplacedError
from .._settings import LegacyKeywords, Settings, current_settings, per_call
from . import mapped
from .reader import CheckpointReader, Device, as_device

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


def open(path: str | os.PathLike[str], *, require_checksums: bool = False,
         settings: Settings | None = None) -> CheckpointReader:
    """Open a checkpoint (ckptstream's or any safetensors file) for lazy, typed reads.

    The header is read and validated now (tensor table, structure, checksums); tensor data only
    when asked, and only the bytes asked for. Use it as a context manager (or ``close()`` it).

    Args:
        path: the checkpoint file.
        require_checksums: refuse a file that stores no checksums (see ``load``).
        settings: the ``Settings`` of this reader's reads (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=64 << 20)``); None: those in force (see
            ``ckptstream.settings``).

    Returns:
        A CheckpointReader: ``keys()`` (every tensor's key path, e.g. "optim.state.0.exp_avg"),
        ``entry(key)`` (dtype, shape, nbytes, checksum, file range), ``leaves`` (non-tensor
        values such as the step), ``metadata``, ``read(key, device=...)``,
        ``read_into(key, tensor)``, ``get_slice(key)[...]`` (a box), ``read_slices(...)``.

    Raises:
        CorruptCheckpointError: the header or structure is malformed (named); a
            ``NotACheckpointError`` for a file of another format (torch.save, DCP ``.metadata``).
        ChecksumsMissingError: ``require_checksums`` and the file stores no checksums.
        OSError: the file cannot be opened.

    Example:
        >>> with ckptstream.open("ckpt.safetensors") as ckpt:
        ...     step = ckpt.leaves["step"]
        ...     wte = ckpt.read("model.wte.weight", device="cuda")
        ...     rows = ckpt.get_slice("model.wte.weight")[1000:2000]
    """
    return CheckpointReader(path, per_call("open", settings, {}), require_checksums=require_checksums)


def once_more_if_replaced(read: Callable[[], T]) -> T:
    """``read()`` (a whole read from an opening of its own), and once more where the object was
    replaced while it was read (an object store): the second reads the new object whole.

    Raises:
        ObjectReplacedError: the second read raced a replace too.
    """
    try:
        return read()
    except ObjectReplacedError:
        pass
    try:
        return read()
    except ObjectReplacedError as e:
        raise ObjectReplacedError(e.url, f"{e.strerror}, and again when read a second time from a new opening: it "
                                  "is being replaced over and over; load it once its writer is done", e.code) from e


def checksum_argument(checksum: bool, verify: bool | None, where: str) -> bool:
    """``checksum``, or the value of 0.1.0's name for it, ``verify``, with a DeprecationWarning."""
    if verify is None:
        return checksum
    warnings.warn(f"{where}(verify=...) is deprecated: use checksum=...", DeprecationWarning, stacklevel=3)
    return verify


def load(path: str | os.PathLike[str], *, device: Device = "cpu", checksum: bool = True, progress: bool = False,
         mmap: bool | None = None, require_checksums: bool = False, verify: bool | None = None,
         settings: Settings | None = None, **legacy: Unpack[LegacyKeywords]) -> Any:
    """Load a state saved by ``save`` (or any safetensors file, as a flat dict).

    Args:
        path: the checkpoint file.
        device: where every tensor lands ("cpu", "cuda", "cuda:1", a torch.device).
        checksum: compare every tensor with its stored CRC-32C (``verify`` in 0.1.0). A file
            without checksums (any safetensors file, or one whose ``__metadata__`` a tool
            dropped) loads unchecked, unless ``require_checksums``.
        progress: show a progress bar on stderr.
        mmap: whether CPU tensors are backed by a private, copy-on-write mapping of the file
            instead of new memory. None (the default): mapped where ``device`` is "cpu" and
            the storage can map the file (a local file), copied otherwise; True: mapped, or
            an error (CPU only); False: always copied into new memory (the tensors then owe
            nothing to the file). A mapped load reads nothing up front except to verify
            checksums: ``checksum=True`` reads every byte once before ``load`` returns, on up
            to ``max(io_threads, hot_io_threads)`` threads, at most one per core. The tensors
            read the file lazily as they are used: the file must not be modified in place or
            truncated while they live (truncation by another program can kill the process
            with SIGBUS; ckptstream's own saves replace files by rename, which is safe).
            Writes to the tensors stay private to this process and never reach the file.
            Tensors whose file offset is not a multiple of their element size (possible in
            files of other writers) are copied instead. No file descriptor stays open.
        require_checksums: refuse, before reading any data, a file that stores no checksums
            (see docs/reliability.md, "Requiring checksums").
        settings: the ``Settings`` of this call (a complete value); None: those in force.
            0.1.0's per-call ``buffer_size`` and ``num_buffers`` are deprecated in its favour.

    Returns:
        The state with its container types, key order, key types and leaves; tensors that
        shared storage when saved share it again.

    Raises:
        CorruptCheckpointError: the file is malformed, truncated or fails a checksum (named); a
            ``NotACheckpointError`` for a file of another format (torch.save, DCP ``.metadata``).
        ChecksumsMissingError: ``require_checksums`` and the file stores no checksums.
        ValueError: ``mmap=True`` with a device other than "cpu".

    Example:
        >>> state = ckptstream.load("ckpt.safetensors", device="cuda")
        >>> weights = ckptstream.load("model.safetensors")                # CPU, mapped
        >>> owned = ckptstream.load("model.safetensors", mmap=False)     # CPU, copied
    """
    checksum = checksum_argument(checksum, verify, "load")
    cfg = per_call("load", settings, legacy)
    if mmap:  # before the file is opened
        mapped.check_device(as_device(device))
    # the collector paused throughout: a load of many tensors allocates a few objects per tensor
    # (none in cycles), and a collection between its phases would scan them all again
    gpu = as_device(device) if checksum and not mmap else None

    def read() -> Any:
        with CheckpointReader(path, cfg, require_checksums=require_checksums) as reader:
            return reader.load(device=device, checksum=checksum, progress=progress, mmap=mmap)

    with _gc.paused(), gpucrc.built_meanwhile(gpu):
        return once_more_if_replaced(read)


def verify(path: str | os.PathLike[str], *, progress: bool = False, require_checksums: bool = False,
           settings: Settings | None = None) -> None:
    """Check a checkpoint without loading it: header, structure, length, and every checksum.

    Args:
        path: the checkpoint file.
        progress: show a progress bar on stderr.
        require_checksums: refuse a file that stores no checksums (otherwise such a file is
            checked for its header, structure and length only).
        settings: the ``Settings`` of the reads (a complete value); None: those in force.

    Raises:
        CorruptCheckpointError: naming what is wrong (and which tensor, for a checksum).
        ChecksumsMissingError: ``require_checksums`` and the file stores no checksums.
    """
    cfg = per_call("verify", settings, {})

    def read() -> None:
        with CheckpointReader(path, cfg, require_checksums=require_checksums) as reader:
            reader.verify(progress=progress)

    once_more_if_replaced(read)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The user's metadata of a checkpoint (without ckptstream's own keys); only the header is
    read."""
    with CheckpointReader(path, current_settings()) as reader:
        return reader.metadata
