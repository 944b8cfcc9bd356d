"""The host memory of "host" snapshots, kept for the next save of the same size.

A "host" save copies the state into host memory at the call: one block per save, page-locked
(pinned) on a GPU machine so that the device-to-host copies run asynchronously at full speed.
Pinning is what the first such save of a process pays for: every page of the block is faulted
in and locked. When a save ends (durable or failed) its block is kept, and lent to the next
"host" save that needs as many bytes: a run whose checkpoints hold the same tensors pays it once,
and ``warm_host_snapshot`` pays it before the first save. At most one block is kept: a save that
needs another size frees the kept one before it allocates its own, and ``release_host_snapshot``
frees it. A block is lent to one save at a time: saves in flight at once never share one.

The blocks are anonymous mmaps registered with CUDA, as the staging buffers are: their size is
the snapshot's, page-rounded, never rounded up to a power of two as torch's pinned allocations
are, and freeing one gives the memory back to the system.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

import torch

__all__ = ["MEMORY", "Block", "SnapshotMemory", "host_snapshot_bytes", "layout", "release_host_snapshot",
           "warm_host_snapshot"]

ALIGN = 64  # each tensor's bytes start at a multiple of it: a view of any dtype
PAGE = 4096


def layout(tensors: list[torch.Tensor]) -> tuple[list[int | None], int]:
    """Each tensor's offset in a block (None for one without elements) and the block's size."""
    offsets: list[int | None] = []
    end = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            offsets.append(None)
            continue
        offsets.append(end)
        end += -(-nbytes // ALIGN) * ALIGN
    return offsets, -(-end // PAGE) * PAGE


class Block:
    """One block of snapshot memory: an anonymous mmap (page-aligned), registered with CUDA
    (page-locked, for every GPU of the process) where ``pinned``."""

    def __init__(self, size: int, pinned: bool) -> None:
        self.size, self.pinned = size, False
        self._map: mmap.mmap | None = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        if pinned:
            err = int(torch.cuda.cudart().cudaHostRegister(self.ptr, size, 1))  # 1: portable
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed (cudaError {err})")
            self.pinned = True

    def free(self) -> None:
        """Unpin the block and let it go. The map is not closed here but unmapped with the last
        tensor that views it (torch keeps it referenced, not exported): a view that outlives its
        save (in a kept traceback) stays valid memory, never a dangling pointer."""
        if self._map is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.pinned = False
        self._map = None
        self.tensor = torch.empty(0, dtype=torch.uint8)


class SnapshotMemory:
    """The process's blocks of snapshot memory: the kept one, and those lent to saves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: Block | None = None
        # referenced until given back: a block collected while registered with CUDA would leave
        # its pages registered, and a later registration of the same addresses would fail
        self._lent: list[Block] = []

    def take(self, size: int, pinned: bool) -> Block:
        """A block of ``size`` bytes for one save: the kept one if it has that size and kind,
        else a new one (the kept one is freed first, so that two are never held idle)."""
        with self._lock:
            kept, self._kept = self._kept, None
            if kept is not None and (kept.size, kept.pinned) == (size, pinned):
                self._lent.append(kept)
                return kept
        if kept is not None:
            kept.free()
        try:
            block = Block(size, pinned)
        except (OSError, RuntimeError) as e:  # mmap's ENOMEM, or the registration with CUDA
            what = "pinned host memory" if pinned else "host memory"
            raise MemoryError(f"mode='host': could not allocate {size / 2**30:.2f} GiB of {what} for the snapshot "
                              f"({e}); free host memory, or pick mode='device' or mode='lazy'") from e
        with self._lock:
            self._lent.append(block)
        return block

    def give_back(self, block: Block) -> None:
        """The save that took ``block`` no longer reads it: keep it for the next save (the newest
        layout wins: an older kept block is freed)."""
        with self._lock:
            self._lent = [b for b in self._lent if b is not block]
            other, self._kept = self._kept, block
        if other is not None and other is not block:
            other.free()

    def release(self) -> int:
        """Free the kept block; returns its bytes (0 without one). Lent blocks stay with their saves."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is None:
            return 0
        kept.free()
        return kept.size

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._lent) + (self._kept.size if self._kept is not None else 0)


MEMORY = SnapshotMemory()


def host_snapshot_bytes() -> int:
    """Bytes of host memory (pinned on a GPU machine) that the snapshots of ``mode="host"`` saves
    hold now: the block kept for the next save and those of saves in flight.

    Example:
        >>> ckptstream.save_async(state, "ckpt.safetensors", mode="host").result()
        >>> ckptstream.host_snapshot_bytes()  # the state's size, kept for the next "host" save
        8459722752
    """
    return MEMORY.held_bytes()


def release_host_snapshot() -> int:
    """Free the snapshot memory kept for the next ``mode="host"`` save (unpin and unmap it);
    returns the bytes freed. Saves in flight keep theirs. The next "host" save allocates anew."""
    return MEMORY.release()


def warm_host_snapshot(state: Any) -> int:
    """Allocate (and pin, on a GPU machine) the snapshot memory of a ``mode="host"`` save of
    ``state`` now, so that the first such save does not pay for it; returns its bytes.

    The memory is kept for the next "host" save whose tensors need as many bytes (the same
    state, or one of the same shapes and dtypes); it replaces memory kept for another size.

    Raises:
        UnsupportedTypeError, TypeError, ValueError: a state ``save_async`` would refuse.
        MemoryError: the host has not that much memory to give (or to pin).

    Example:
        >>> ckptstream.warm_host_snapshot({"model": model.state_dict(), "optim": opt.state_dict()})
        8459722752
    """
    from .save import plan_checkpoint  # the file's tensors, as the save will capture them

    tensors = plan_checkpoint(state, None, checksum=False).tensors
    _, size = layout(tensors)
    if size:
        MEMORY.give_back(MEMORY.take(size, pinned=any(t.is_cuda for t in tensors)))
    return size
