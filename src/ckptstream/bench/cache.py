"""Making a load cold: evict a checkpoint's files from the page cache, and check that it worked.

Two ways, best first: drop the whole page cache (root and a writable /proc/sys/vm/drop_caches),
or posix_fadvise(POSIX_FADV_DONTNEED) on each file after fsync (clean pages of that file only).
Either way ``resident_fraction`` (mincore) tells how much of the files is still cached, so a
load that could not be made cold is reported as "warm" rather than passed off as cold.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import mmap
import os
from collections.abc import Iterable, Iterator
from typing import Any

DROP_CACHES = "/proc/sys/vm/drop_caches"
STILL_COLD = 0.05  # at most this fraction of the bytes may stay cached for a load to count as cold


class Cold(str, enum.Enum):
    AUTO = "auto"
    DROP_CACHES = "drop_caches"
    FADVISE = "fadvise"
    NONE = "none"


def drop_caches_allowed() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


def cold_method(requested: Cold, *, gentle: bool = False) -> Cold:
    """The method ``auto`` stands for on this machine; an explicit one that cannot work is an error.

    ``gentle`` (--quick) prefers fadvise: dropping every cache also evicts torch's own libraries,
    and each following process then spends seconds reading them back from disk.
    """
    if requested is Cold.AUTO:
        if drop_caches_allowed() and not (gentle and hasattr(os, "posix_fadvise")):
            return Cold.DROP_CACHES
        return Cold.FADVISE if hasattr(os, "posix_fadvise") else Cold.NONE
    if requested is Cold.DROP_CACHES and not drop_caches_allowed():
        raise PermissionError(f"--cold drop_caches needs root and a writable {DROP_CACHES}; use --cold fadvise or auto")
    if requested is Cold.FADVISE and not hasattr(os, "posix_fadvise"):
        raise OSError("--cold fadvise: posix_fadvise is not available on this platform")
    return requested


def files_under(path: str) -> list[str]:
    """The regular files of a checkpoint: the file itself, or every file below its directory."""
    if os.path.isfile(path):
        return [path]
    found: list[str] = []
    for root, _, names in os.walk(path):
        found.extend(os.path.join(root, n) for n in sorted(names))
    return found


def drop_all() -> None:
    os.sync()  # drop_caches only drops clean pages: write the dirty ones first
    with open(DROP_CACHES, "w") as f:
        f.write("3")


def fadvise_out(files: Iterable[str]) -> None:
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict(method: Cold, files: Iterable[str], *, lead: bool = True) -> None:
    """Evict ``files`` by ``method``; with several processes only the ``lead`` one drops caches."""
    if method is Cold.DROP_CACHES:
        if lead:
            drop_all()
    elif method is Cold.FADVISE:
        fadvise_out(files)


_libc: ctypes.CDLL | None = None


def _mincore() -> Any:
    global _libc
    with contextlib.suppress(OSError):
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
    return getattr(_libc, "mincore", None)


@contextlib.contextmanager
def _mapped(name: str, size: int) -> Iterator[int]:
    """The address of a private read mapping of the file (mincore needs one; nothing is read)."""
    with open(name, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            yield ctypes.addressof(anchor)
        finally:
            del anchor  # the mapping cannot close while a ctypes object points into it
    finally:
        mm.close()


def resident_fraction(files: Iterable[str]) -> float | None:
    """Fraction of the files' bytes in the page cache now; None where mincore is unavailable."""
    fn = _mincore()
    if fn is None:
        return None
    cached = total = 0
    for name in files:
        size = os.path.getsize(name)
        if not size:
            continue
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        with _mapped(name, size) as addr:
            if fn(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return None
        cached += pages - bytes(vec).count(0)
        total += pages
    return cached / total if total else 0.0


def cold_label(method: Cold, worst_resident: float | None) -> str:
    """What to call the loads measured after ``evict``: "cold" only when it demonstrably was."""
    if method is Cold.NONE or (worst_resident is not None and worst_resident > STILL_COLD):
        return "warm"
    return "cold"
