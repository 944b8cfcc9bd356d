"""The native loop of a hot load into a GPU (hotloop.c): one call moves an I/O thread's range.

The read engine uses it where a thread's every chunk is plain (contiguous tensors of one device,
copied by address, no bytes checksummed on the host) and the file gives a descriptor; the CUDA
calls come as function pointers (``Calls``): the runtime torch loaded, or the test suite's
simulated GPU. ``LIBRARY`` is None where the extension was not built; the engine's Python loop
then runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from .control import Stopped

log = logging.getLogger(__name__)

OK, STOPPED, READ_ERROR, SHORT, COPY_ERROR, WAIT_ERROR, RECORD_ERROR = range(7)
_CALL = {COPY_ERROR: "cudaMemcpyAsync", WAIT_ERROR: "cudaEventSynchronize", RECORD_ERROR: "cudaEventRecord"}
_P = ctypes.c_void_p


def _load() -> ctypes.CDLL | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "_hotloop*.so"))):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.hot_load
        except (OSError, AttributeError) as e:
            log.debug("%s: not usable (%s)", path, e)
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_int64, _P, _P, _P, _P, _P, _P, _P, _P, _P]
        return lib
    log.debug("the native hot-load loop is not built: the Python loop runs")
    return None


LIBRARY = _load()


def _synchronize(address: int) -> Any:
    """The event-synchronize call at ``address`` (a C function pointer), callable from Python;
    ctypes gives the interpreter lock up while it waits."""
    return ctypes.CFUNCTYPE(ctypes.c_int, _P)(address)


@dataclasses.dataclass
class Calls:
    """The device calls of one side stream, as C function pointers, and the events of a
    thread's staging buffers (``keep``: what must stay alive while they are used)."""

    memcpy_async: int
    record: int
    synchronize: int
    stream: int
    events: list[int]
    keep: Any = None
    name_of: Any = None  # status -> the runtime's name for it (cudaGetErrorString)

    def wait_all(self) -> None:
        """Wait for the copies out of every buffer (a call's loop refills its buffers from the
        first without waiting: it knows only its own copies)."""
        for event in self.events:
            status = _synchronize(self.synchronize)(event)
            if status != 0:
                name = self.name_of(status) if self.name_of is not None else "error"
                raise RuntimeError(f"cudaEventSynchronize failed between calls of the hot-load loop: {name} ({status})")


@dataclasses.dataclass
class Result:
    """What one call did: ``moved`` bytes; on failure, the chunk (an index into the call's
    chunks) and the status with its value (errno, CUDA status, or where the file ended)."""

    status: int
    chunk: int
    value: int
    moved: int

    @property
    def file_end(self) -> int | None:
        """Where the file ended, for a file shorter than its chunks."""
        return self.value if self.status == SHORT else None

    def check(self, path: str, chunk: tuple[int, int, int, int], calls: Calls) -> None:
        """Raise what the Python loop raises for the same failure: OSError naming the file (as
        its reads do), RuntimeError for a CUDA error (as torch reports them), Stopped where the
        transfer was stopped."""
        status, value = self.status, self.value
        if status == STOPPED:
            raise Stopped()
        if status == READ_ERROR:
            raise OSError(value, f"{os.strerror(value)} (reading {chunk[2]} bytes at offset {chunk[0]})", path)
        if status in _CALL:
            name = calls.name_of(value) if calls.name_of is not None else "error"
            raise RuntimeError(f"{_CALL[status]} failed in the hot-load loop of {path}: {name} ({value})")


def run(fd: int, buffers: Sequence[int], calls: Calls, chunks: Sequence[tuple[int, int, int, int]],
        parts: Sequence[Sequence[tuple[int, int, int]]], stop: ctypes.c_int32) -> Result:
    """Move ``chunks`` (file offset, offset in the staging buffer, bytes to read, bytes needed)
    through ``buffers`` in turn, each chunk's ``parts`` (offset in the buffer, device address,
    bytes) copied to the device on ``calls.stream``, until done, a failure, or ``stop`` set."""
    assert LIBRARY is not None
    table: list[int] = []
    first = 0
    for chunk, its in zip(chunks, parts, strict=True):
        table += [*chunk, first]
        first += len(its)
    table += [0, 0, 0, 0, first]
    chunk_table = torch.tensor(table, dtype=torch.int64)
    part_table = torch.tensor([x for its in parts for part in its for x in part] or [0], dtype=torch.int64)
    bufs = (ctypes.c_void_p * len(buffers))(*buffers)
    events = (ctypes.c_void_p * len(calls.events))(*calls.events)
    done, info = ctypes.c_int64(0), (ctypes.c_int64 * 2)()
    status = LIBRARY.hot_load(fd, bufs, events, len(buffers), len(chunks), chunk_table.data_ptr(),
                              part_table.data_ptr(), calls.memcpy_async, calls.record, calls.synchronize,
                              calls.stream, ctypes.byref(stop), ctypes.byref(done), info)
    return Result(status, info[0], info[1], done.value)
