"""A private mapping of a local file's bytes, for ``load(..., mmap=True)`` (see ``_checkpoint.mapped``).

The mapping is made with libc's ``mmap`` (not Python's ``mmap`` module, which keeps a duplicate
of the file descriptor open for as long as the mapping lives, before Python 3.13): the mapping
holds the file, not a descriptor, so loading many files maps them without using descriptors.
It is unmapped when the last object made from its buffer is freed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import Any

from .base import round_down
from .fileio import os_error, pages_in_memory

# MADV_POPULATE_READ (Linux 5.14): fault every page of a range in one call, which reads a range
# not yet in the page cache in large requests. Older kernels refuse it (EINVAL): then the pages
# fault in as they are read.
MADV_POPULATE_READ = 22
SAMPLE = 64 << 10  # bytes at each end of a range whose residency stands for the whole range's

_libc: Any = None


def _c() -> Any:
    """libc with the prototypes used here, loaded on first use."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


class Mapping:
    """A private, writable mapping of ``nbytes`` of a file from ``offset`` (a multiple of the
    page size). ``buffer`` exports the mapped bytes; the mapping is undone once ``buffer`` and
    every object made from it are gone (never at interpreter exit: tensors may outlive that)."""

    def __init__(self, fd: int, offset: int, nbytes: int, path: str) -> None:
        libc = _c()
        addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            errno = ctypes.get_errno()
            raise os_error(OSError(errno, os.strerror(errno)), "mapping the checkpoint", path)
        self.addr, self.nbytes, self.offset = int(addr), nbytes, offset
        self.buffer = (ctypes.c_ubyte * nbytes).from_address(self.addr)
        weakref.finalize(self.buffer, libc.munmap, self.addr, nbytes).atexit = False

    def advise(self, lo: int, hi: int, advice: int) -> bool:
        """madvise the mapped pages holding bytes [lo, hi) (of the mapping); whether it took."""
        start = round_down(lo, mmap.PAGESIZE)
        return hi > lo and _c().madvise(self.addr + start, hi - start, advice) == 0

    def resident(self, lo: int, hi: int) -> bool:
        """Whether the pages at both ends of bytes [lo, hi) (SAMPLE bytes each, or all of a
        shorter range) are in the page cache: a sample, since the kernel answers page by page,
        and it is asked before the checksums start. False where the kernel cannot tell (it may
        then report only the pages mapped here)."""
        if hi - lo <= 2 * SAMPLE:
            return hi <= lo or self._in_cache(lo, hi)
        return self._in_cache(lo, lo + SAMPLE) and self._in_cache(hi - SAMPLE, hi)

    def _in_cache(self, lo: int, hi: int) -> bool:
        start = round_down(lo, mmap.PAGESIZE)
        pages = pages_in_memory(self.addr + start, hi - start)
        return pages is not None and pages.count(0) == 0

    def prefetch(self, lo: int, hi: int) -> bool:
        """Fault in the pages of bytes [lo, hi) in one call, where the kernel can."""
        return self.advise(lo, hi, MADV_POPULATE_READ)
