"""Staging buffers: page-aligned host memory, page-locked (pinned) on a CUDA machine, pooled.

Buffers are anonymous mmaps (page-aligned, as O_DIRECT needs) registered with CUDA so that
device copies into and out of them run asynchronously at full PCIe speed. They are reused
across transfers and released at interpreter exit or by ``release_all``.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import threading

import torch


class StagingBuffer:
    """One aligned host buffer, seen as a uint8 tensor (for device copies) and a memoryview (for I/O)."""

    def __init__(self, size: int, pinned: bool) -> None:
        self.size, self.pinned = size, pinned
        self._map = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        self.view = memoryview((ctypes.c_char * size).from_address(self.ptr)).cast("B")
        if pinned:
            # portable (flag 1): pinned for every GPU of the process, not only the current one
            err = int(torch.cuda.cudart().cudaHostRegister(self.ptr, size, 1))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of a {size}-byte staging buffer failed (cudaError {err})")

    def free(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.pinned = False
        self.view.release()
        del self.tensor
        self._map.close()


class BufferPool:
    """Process-wide pool of idle staging buffers, keyed by (size, pinned). It keeps the idle
    buffers of the last kind asked for only: a transfer with other settings (a hot load splits
    the same staging into more, smaller buffers) frees the others, so the pool never holds two
    transfers' worth of staging."""

    def __init__(self) -> None:
        self._idle: dict[tuple[int, bool], list[StagingBuffer]] = {}
        self._lock = threading.Lock()
        self.in_use = 0  # buffers lent to transfers
        self._lent_bytes = 0

    def acquire(self, size: int, count: int, pinned: bool) -> list[StagingBuffer]:
        with self._lock:
            other = [buf for key, bufs in self._idle.items() if key != (size, pinned) for buf in bufs]
            self._idle = {(size, pinned): self._idle.get((size, pinned), [])}
            idle = self._idle[(size, pinned)]
            taken = [idle.pop() for _ in range(min(count, len(idle)))]
        for buf in other:
            buf.free()
        try:
            while len(taken) < count:
                taken.append(StagingBuffer(size, pinned))
        except BaseException:
            with self._lock:
                self._idle[(size, pinned)].extend(taken)
            raise
        with self._lock:
            self.in_use += count
            self._lent_bytes += count * size
        return taken

    def release(self, buffers: list[StagingBuffer]) -> None:
        with self._lock:
            for buf in buffers:
                self._idle.setdefault((buf.size, buf.pinned), []).append(buf)
            self.in_use -= len(buffers)
            self._lent_bytes -= sum(b.size for b in buffers)

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.size for bufs in self._idle.values() for b in bufs)

    def allocated_bytes(self) -> int:
        """Bytes of staging held by the pool: idle buffers and those lent to transfers."""
        with self._lock:
            return self._lent_bytes + sum(b.size for bufs in self._idle.values() for b in bufs)

    def release_all(self) -> int:
        """Free every idle buffer (unpin and unmap); returns the bytes freed. Buffers in use stay
        with their transfer."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for bufs in idle.values():
            for buf in bufs:
                buf.free()
        return sum(b.size for bufs in idle.values() for b in bufs)


POOL = BufferPool()
atexit.register(POOL.release_all)


def staging_bytes() -> int:
    """Bytes of host staging memory (pinned on a GPU machine) that ckptstream holds now.

    Transfers keep their staging buffers in a process-wide pool for the next transfer; this is
    the pool's size, buffers in use included. Example:
        >>> ckptstream.save(state, "ckpt.safetensors")
        >>> ckptstream.staging_bytes()  # num_buffers x buffer_size of the save
        134217728
    """
    return POOL.allocated_bytes()


def release_staging() -> int:
    """Free the idle staging buffers (unpin and unmap them); returns the bytes freed. Buffers of
    transfers still running stay with them. The next transfer allocates anew."""
    return POOL.release_all()
