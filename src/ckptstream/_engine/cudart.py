"""Host-to-device copies that do not hold the interpreter lock.

A load into a GPU from the page cache keeps many I/O threads busy, each reading a chunk into its
staging buffer and queueing that chunk's copies to the device. A copy queued through torch holds
the interpreter lock for its dispatch and launch (tens of microseconds); with 16 threads and
chunks of a few MiB, the threads then queue for the lock and the copies fall behind the reads
(docs/benchmarks.md, "A copy loop without the interpreter lock"). ``cudaMemcpyAsync`` called
through ctypes gives the lock up for the call, so the threads' launches overlap like their reads.

The CUDA runtime is the one torch has loaded (found among the process's mapped files): the same
library, so the same contexts and streams as torch's. Where it is not found (a build that links
it statically, another accelerator), ``copier`` returns None and the engine copies through torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from collections.abc import Callable

log = logging.getLogger(__name__)

H2D = 1  # cudaMemcpyHostToDevice
_LIBRARY = re.compile(r"(/\S*/libcudart\.so[.\d]*)\s*$")

Copier = Callable[[int, int, int], None]  # (device address, host address, bytes)


@functools.lru_cache(maxsize=1)
def runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {m.group(1) for m in map(_LIBRARY.search, maps) if m}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        except (OSError, AttributeError) as e:
            log.debug("%s: not usable for copies (%s)", path, e)
            continue
        return lib
    return None


def copier(stream_handle: int) -> Copier | None:
    """A function queueing host-to-device copies on the stream ``stream_handle`` (a
    ``cudaStream_t``, as ``torch.cuda.Stream.cuda_stream``), or None where the runtime is not
    found. The host memory must be page-locked, as the staging buffers are."""
    lib = runtime()
    if lib is None:
        return None
    memcpy, stream = lib.cudaMemcpyAsync, ctypes.c_void_p(stream_handle)

    def copy(dst: int, src: int, nbytes: int) -> None:
        status = memcpy(dst, src, nbytes, H2D, stream)
        if status:  # a device in an error state, or a bad address (a bug): as torch reports CUDA errors
            name = lib.cudaGetErrorString(status).decode(errors="replace")
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes to device address {dst:#x} failed: "
                               f"{name} ({status})")
    return copy


def native_calls() -> tuple[int, int, int] | None:
    """The addresses of ``cudaMemcpyAsync``, ``cudaEventRecord`` and ``cudaEventSynchronize`` in
    the runtime torch loaded (for the native hot-load loop), or None where it is not found."""
    lib = runtime()
    if lib is None:
        return None
    try:
        calls = lib.cudaMemcpyAsync, lib.cudaEventRecord, lib.cudaEventSynchronize
    except AttributeError:
        return None
    a, b, c = (ctypes.cast(f, ctypes.c_void_p).value or 0 for f in calls)
    return a, b, c


def error_name(status: int) -> str:
    lib = runtime()
    return lib.cudaGetErrorString(status).decode(errors="replace") if lib is not None else "error"
