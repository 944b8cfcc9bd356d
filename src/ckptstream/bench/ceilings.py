"""What the hardware allows for the same byte count: raw sequential write (O_DIRECT + fsync) and
cold raw read (O_DIRECT) from page-aligned host memory, a hot page-cache read, and on a GPU the
pinned device-to-host and host-to-device copy rates. No serialisation, no device copies.

``run_ceilings`` is the worker's job that measures them all, per thread count.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from . import cache
from .cache import Cold
from .formats import MiB, short_number
from .job import Job, say, spec_of
from .multirank import Group

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
RING = 256 * MiB  # distinct source bytes, reused cyclically: no need to hold the whole state twice


def block_for(nbytes: int) -> int:
    """Block size: 64 MiB (large sequential I/O, as a checkpoint writes), smaller for tiny states
    so that every thread gets work."""
    block = 64 * MiB
    while block > MiB and block * 8 > nbytes:
        block //= 2
    return block


def _aligned(size: int) -> mmap.mmap:
    """Page-aligned (as O_DIRECT needs) and populated: first-touch page faults inside a timed
    read would measure the page allocator, not the disk or the page cache."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open with O_DIRECT where asked and allowed; fall back to buffered I/O (tmpfs refuses it)."""
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT | os.O_CLOEXEC, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags | os.O_CLOEXEC, 0o644), False


def _blocks(nbytes: int, block: int) -> list[tuple[int, int]]:
    """(offset, length) of each block; lengths rounded up to 4 KiB for O_DIRECT."""
    out = []
    for off in range(0, nbytes, block):
        length = min(block, nbytes - off)
        out.append((off, -(-length // 4096) * 4096))
    return out


def _parallel(threads: int, blocks: list[tuple[int, int]], work: Callable[[int, tuple[int, int]], None]) -> None:
    """Thread t does blocks t, t+T, t+2T, ...: together the threads sweep the file front to back.
    On an error or Ctrl-C the threads stop after their current block (their buffers stay in use
    until then)."""
    stop = threading.Event()

    def run(t: int) -> None:
        for blk in blocks[t::threads]:
            if stop.is_set():
                return
            work(t, blk)

    with concurrent.futures.ThreadPoolExecutor(threads, "bench-raw") as pool:
        try:
            for f in [pool.submit(run, t) for t in range(threads)]:
                f.result()
        finally:
            stop.set()


def _close(*maps: mmap.mmap) -> None:
    for m in maps:
        with contextlib.suppress(BufferError):  # still exported by an interrupted thread: freed at exit
            m.close()


_rings: dict[int, mmap.mmap] = {}


def _ring(size: int) -> mmap.mmap:
    """``size`` random page-aligned bytes, made once per process (filling them takes a while)."""
    if size not in _rings:
        _rings.clear()
        ring = _aligned(size)
        torch.frombuffer(ring, dtype=torch.uint8).random_(0, 256)
        _rings[size] = ring
    return _rings[size]


def raw_write(path: str, nbytes: int, threads: int, block: int) -> tuple[float, bool]:
    """Seconds to write ``nbytes`` of random bytes and fsync; and whether O_DIRECT was used."""
    ring_size = max(block, min(RING, nbytes) // block * block)
    view = memoryview(_ring(ring_size))
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct=True)

    def work(_: int, blk: tuple[int, int]) -> None:
        off, length = blk
        src = (off % ring_size) if off % ring_size + length <= ring_size else 0
        done = 0
        while done < length:
            done += os.pwrite(fd, view[src + done : src + length], off + done)

    try:
        start = time.perf_counter()
        _parallel(threads, _blocks(nbytes, block), work)
        os.fsync(fd)
        return time.perf_counter() - start, direct
    finally:
        os.close(fd)
        with contextlib.suppress(BufferError):
            view.release()


def raw_read(path: str, nbytes: int, threads: int, block: int, *, direct: bool) -> float:
    """Seconds to read ``nbytes`` of ``path`` into per-thread page-aligned buffers."""
    fd, _ = _open(path, os.O_RDONLY, direct=direct)
    buffers = [_aligned(block) for _ in range(threads)]

    def work(t: int, blk: tuple[int, int]) -> None:
        off, length = blk
        with memoryview(buffers[t]) as view:
            done = 0
            while done < length:
                n = os.preadv(fd, [view[done:length]], off + done)
                if n == 0:
                    break
                done += n

    try:
        start = time.perf_counter()
        _parallel(threads, _blocks(nbytes, block), work)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        _close(*buffers)


def copy_rates(device: str, nbytes: int, chunk: int = 64 * MiB) -> dict[str, float]:
    """Pinned D2H and H2D GB/s over ``nbytes`` (at most 1 GiB) in ``chunk`` pieces, best of 3."""
    if torch.device(device).type != "cuda":
        return {}
    n = max(chunk, min(nbytes, 1 << 30) // chunk * chunk)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
    rates: dict[str, float] = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for off in range(0, n, chunk):
                dst[off : off + chunk].copy_(src[off : off + chunk], non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates[name] = n / best / 1e9
    return rates


def run_ceilings(job: Job, group: Group) -> dict[str, Any]:
    """Seconds of each raw write, cold read and hot read per thread count, ``job["repeat"]``
    times each, on all ranks at once; and the pinned copy rates on a GPU."""
    nbytes, cold = spec_of(job, group).nbytes(), Cold(job["cold"])
    block = block_for(nbytes)
    os.makedirs(job["dir"], exist_ok=True)
    path = os.path.join(job["dir"], f"raw.rank{group.rank}")
    threads, hot_threads = job["threads"], job["hot_threads"]
    out: dict[str, Any] = {"bytes": nbytes, "block": block, "resident": []}
    for kind in ("write", "read", "hot"):
        out[kind] = {str(t): [] for t in (hot_threads if kind == "hot" else threads)}

    def measure(kind: str, t: int, fn: Callable[[], float]) -> None:
        group.barrier()
        seconds = fn()
        group.barrier()
        out[kind][str(t)].append(seconds)
        say(group, f"ceiling {kind}, {t} thread(s): {short_number(nbytes / seconds / 1e9)} GB/s "
                   f"({short_number(seconds)} s)")

    def write(t: int) -> float:
        seconds, out["direct"] = raw_write(path, nbytes, t, block)
        return seconds

    try:
        for _ in range(job["repeat"]):
            for t in threads:
                measure("write", t, partial(write, t))
            for t in threads:
                cache.evict(cold, [path], lead=group.lead)
                group.barrier()
                out["resident"].append(cache.resident_fraction([path]))
                measure("read", t, partial(raw_read, path, nbytes, t, block, direct=True))
            if hot_threads:
                raw_read(path, nbytes, max(hot_threads), block, direct=False)  # fill the cache
                for t in hot_threads:
                    measure("hot", t, partial(raw_read, path, nbytes, t, block, direct=False))
        if group.cuda:
            out.update(copy=copy_rates(group.device, nbytes), gpu=torch.cuda.get_device_name(group.device),
                       gpus=torch.cuda.device_count())
            if out["copy"]:
                say(group, "ceiling copies (pinned): D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s".format(**out["copy"]))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return out
