"""Measuring one operation: wall time with the device drained, and peak host RSS over the
process's baseline at the start of the operation."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .state import iter_tensors

T = TypeVar("T")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SMALL_PAGES = 16  # touch() reads tensors of fewer pages through ctypes


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """Current resident set size (anonymous + file-backed pages, as `ps` shows it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where /proc refuses it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS growth over the RSS at ``__enter__``.

    The kernel's high-water mark (reset through clear_refs) sees every page, even one touched
    for a microsecond; where clear_refs is not writable a thread samples /proc/self/statm
    every millisecond instead and ``method`` says so.
    """

    def __init__(self) -> None:
        self.baseline = self.peak = 0
        self.method = "VmHWM"
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        if _reset_high_water_mark():
            self.baseline = rss_bytes()
        else:
            self.method = "sampled"
            self.baseline = self.peak = rss_bytes()
            self._sampler = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self.peak = max(self.peak, rss_bytes())
        else:
            self.peak = _status_kib("VmHWM") * 1024

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.baseline)


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: str | torch.device) -> tuple[float, T]:
    """Seconds ``fn`` takes until its device work has finished too (CUDA copies are async)."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def touch(state: Any) -> None:
    """Bring every byte of the CPU tensors in ``state`` into memory: read one byte of each page
    that holds any of a tensor's bytes (a page comes in whole).

    torch.load(mmap=True), and safetensors on the CPU, map the file and return before the data
    has been read; a load has finished only once the data is in memory, so every load is timed
    with this included (it costs one read per page where the memory is resident already). A
    tensor of a few pages is read byte by byte through ctypes, which costs a fraction of a torch
    operation's launch, so that a state of many small tensors is not charged for the measuring.
    """
    for _, t in iter_tensors(state):
        if t.device.type != "cpu" or not t.numel():
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own bytes: its shard
        begin = t.data_ptr()
        reach = t.nbytes if t.is_contiguous() else (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(),
                                                                                       strict=True))) * t.element_size()
        first, last = begin // PAGE, (begin + reach - 1) // PAGE
        if last - first < SMALL_PAGES:
            ctypes.string_at(begin, 1)
            for page in range(first + 1, last + 1):
                ctypes.string_at(page * PAGE, 1)
            continue
        data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                      (reach,), (1,))
        # the tensor's first page, then every page boundary inside its reach: its last, partial page too
        boundary = -begin % PAGE
        data[:1].sum()
        data[boundary::PAGE].sum()


def release_memory() -> None:
    """Hand freed memory back to the OS so that the next baseline is not inflated by garbage."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Peers warn about things that are not the benchmark's business (DCP without a process group)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
