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
from .fileio import os_error

# MADV_POPULATE_READ (Linux 5.14): fault every page of a range in one call, far cheaper than one
# fault per page. Older kernels refuse it (EINVAL): then the pages fault in as they are read.
MADV_POPULATE_READ = 22

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

    def prefetch(self, lo: int, hi: int) -> bool:
        """Fault in the pages of bytes [lo, hi) in one call, where the kernel can."""
        return self.advise(lo, hi, MADV_POPULATE_READ)
