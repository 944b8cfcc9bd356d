"""What the hardware allows for the same byte count, each the best of a sweep of mechanisms
(``probes``): raw sequential writes + fsync and cold raw reads, with O_DIRECT or through the page
cache, blocks taken in turn or one contiguous range per thread with readahead, 1 to 64 threads,
1 to 64 MiB; hot page-cache reads; host memory's copy rate; on a GPU the pinned device-to-host
and host-to-device copy rates, and a hot load's own ceiling: the page cache -> pinned buffers ->
device pipeline at its best (``pipeline_read``), each byte crossing host memory three times. No
serialisation, no checksums, no tensors. (The one piece of the library used: the engine's way to
queue copies by address without the interpreter lock, ``cudart``, which a bare loop needs too to
reach the machine's rate.)

``run_ceilings`` is the worker's job that measures them all.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from .._engine import cudart, hotloop
from .._engine import streams as engine_streams
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


def _parallel(per_thread: list[list[tuple[int, int]]], work: Callable[[int, tuple[int, int]], None]) -> None:
    """Thread t does the blocks ``per_thread[t]`` in order. On an error or Ctrl-C the threads
    stop after their current block (their buffers stay in use until then)."""
    stop = threading.Event()

    def run(t: int) -> None:
        for blk in per_thread[t]:
            if stop.is_set():
                return
            work(t, blk)

    with concurrent.futures.ThreadPoolExecutor(len(per_thread), "bench-raw") as pool:
        try:
            for f in [pool.submit(run, t) for t in range(len(per_thread))]:
                f.result()
        finally:
            stop.set()


def _schedule(nbytes: int, probe: Probe, block: int) -> list[list[tuple[int, int]]]:
    """Per thread, its blocks: one contiguous range each ("ranges"), or blocks t, t+T, t+2T, ...
    (together the threads sweep the file front to back)."""
    blocks, threads = _blocks(nbytes, block), probe.threads
    if probe.how in ("ranges", "pinned-ranges", "native-ranges"):
        per = -(-len(blocks) // threads)
        return [blocks[t * per : (t + 1) * per] for t in range(threads)]
    return [blocks[t::threads] for t in range(threads)]


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


@dataclasses.dataclass(frozen=True)
class Probe:
    """One way to move the bytes: ``how`` is "direct" (O_DIRECT, the threads take the blocks in
    turn), "buffered" (the same through the page cache) or "ranges" (buffered, each thread reads
    one contiguous range front to back in ``block`` reads, readahead advised: deep sequential
    streams, as the fastest loaders read)."""

    # or "pinned": page cache -> two pinned buffers per thread -> device, blocks taken in turn and
    # copied through torch; "pinned-ranges": one buffer per thread, one contiguous range each,
    # copies queued by address without the interpreter lock; "native-ranges": the same moved by
    # the C loop of hot loads (hotloop.c), one call per thread, a descriptor each (pipeline_read)
    how: str
    threads: int
    block: int

    @property
    def label(self) -> str:
        return f"{self.how} {self.threads}x{format_mib(self.block)}"


def format_mib(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // 1024}KiB"


def disk_blocks(threads: int) -> tuple[int, ...]:
    """Block sizes tried with ``threads`` threads: a few deep requests or many shallow ones."""
    if threads <= 1:
        return (64 * MiB,)
    if threads <= 4:
        return (64 * MiB, 8 * MiB)
    if threads <= 16:
        return (8 * MiB, 2 * MiB)
    return (MiB,)


def probes(kind: str, threads: Sequence[int], hot_threads: Sequence[int], nbytes: int) -> list[Probe]:
    """The sweep of one ceiling ("write", "read" cold, "hot"). Blocks shrink to fit a small
    state (``block_for``), and a probe that would leave a thread without a block is left out."""
    if kind == "hot":
        wanted = [(how, t, b) for t in hot_threads for how, b in (("buffered", 8 * MiB), ("ranges", 2 * MiB))]
    else:
        wanted = [("direct", t, b) for t in threads for b in disk_blocks(t)]
        extra = ("buffered", 16 * MiB) if kind == "write" else ("ranges", 2 * MiB)
        wanted += [(extra[0], t, extra[1]) for t in threads if t > 1 or len(threads) == 1]
    out: list[Probe] = []
    for how, t, b in wanted:
        probe = Probe(how, t, min(b, block_for(nbytes)))
        if probe not in out and (t * probe.block <= nbytes or not out):
            out.append(probe)
    return out


def pipeline_probes(hot_threads: Sequence[int], nbytes: int) -> list[Probe]:
    """The sweep of a hot load into a GPU: each thread count x 16 MiB (and 8 threads, the
    engine's default, where the machine has them), the most threads x 64 MiB; the most threads
    x 8 and 16 MiB on ranges, one buffer each (a bare loop's fastest on an H200:
    docs/benchmarks.md)."""
    if not hot_threads:
        return []
    most = max(hot_threads)
    wanted = [("pinned", t, 16 * MiB) for t in sorted({*hot_threads, *([8] if most >= 8 else [])})]
    wanted += [("pinned", most, 64 * MiB), ("pinned-ranges", most, 8 * MiB), ("pinned-ranges", most, 16 * MiB)]
    if hotloop.LIBRARY is not None and cudart.native_calls() is not None:
        wanted += [("native-ranges", most, 8 * MiB)]
    out: list[Probe] = []
    for how, t, b in wanted:
        probe = Probe(how, t, min(b, block_for(nbytes)))
        if probe not in out and (t * probe.block <= nbytes or not out):
            out.append(probe)
    return out


def raw_write(path: str, nbytes: int, probe: Probe) -> tuple[float, bool]:
    """Seconds to write ``nbytes`` of random bytes and fsync; and whether O_DIRECT was used."""
    block = probe.block
    ring_size = max(block, min(RING, nbytes) // block * block)
    view = memoryview(_ring(ring_size))
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct=probe.how == "direct")

    def work(_: int, blk: tuple[int, int]) -> None:
        off, length = blk
        src = (off % ring_size) if off % ring_size + length <= ring_size else 0
        done = 0
        while done < length:
            done += os.pwrite(fd, view[src + done : src + length], off + done)

    try:
        start = time.perf_counter()
        _parallel(_schedule(nbytes, probe, block), work)
        os.fsync(fd)
        return time.perf_counter() - start, direct
    finally:
        os.close(fd)
        with contextlib.suppress(BufferError):
            view.release()


def raw_read(path: str, nbytes: int, probe: Probe) -> float:
    """Seconds to read ``nbytes`` of ``path`` into per-thread page-aligned buffers."""
    block = probe.block
    fd, _ = _open(path, os.O_RDONLY, direct=probe.how == "direct")
    if probe.how == "ranges" and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buffers = [_aligned(block) for _ in range(probe.threads)]

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
        _parallel(_schedule(nbytes, probe, block), work)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        _close(*buffers)


def pipeline_read(path: str, nbytes: int, probe: Probe, device: str, dst: torch.Tensor | None = None) -> float:
    """Seconds to move ``nbytes`` of ``path`` (in the page cache) into device memory: each thread
    reads its blocks into its pinned buffers in turn (two; one for "pinned-ranges") and copies
    each to the device on a stream of its own while it reads the next. Into ``dst`` (uint8, where
    it holds ``nbytes``) or a device ring of at most 1 GiB: no need for room for the whole state."""
    block, threads = probe.block, probe.threads
    ring = max(block, min(nbytes, 1 << 30) // block * block) if dst is None else dst.numel()
    if dst is None:
        dst = torch.empty(ring, dtype=torch.uint8, device=device)
    if probe.how == "native-ranges":
        return _native_pipeline(path, nbytes, probe, dst)
    count = 1 if probe.how == "pinned-ranges" else 2
    # torch's pinned memory (its host allocator keeps it for the process: a ceilings job's own)
    pins = [[torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(count)] for _ in range(threads)]
    views = [[memoryview(p.numpy()).cast("B") for p in pair] for pair in pins]  # type: ignore[arg-type]
    streams = [torch.cuda.Stream(device) for _ in range(threads)]
    copiers = [cudart.copier(s.cuda_stream) if probe.how == "pinned-ranges" else None for s in streams]
    turns = [0] * threads
    pending: list[list[Any]] = [[None] * count for _ in range(threads)]
    fd, _ = _open(path, os.O_RDONLY, direct=False)

    def work(t: int, blk: tuple[int, int]) -> None:
        off, length = blk
        side = turns[t] % count
        turns[t] += 1
        if pending[t][side] is not None:
            pending[t][side].synchronize()  # the buffer's previous copy is done
        buf, view, done = pins[t][side], views[t][side], 0
        while done < length:
            n = os.preadv(fd, [view[done:length]], off + done)
            if n == 0:
                break
            done += n
        at = off % ring if off % ring + done <= ring else 0
        with torch.cuda.stream(streams[t]):
            if (copy := copiers[t]) is not None:
                copy(dst.data_ptr() + at, buf.data_ptr(), done)
            else:
                dst[at : at + done].copy_(buf[:done], non_blocking=True)
            pending[t][side] = streams[t].record_event()

    try:
        start = time.perf_counter()
        _parallel(_schedule(nbytes, probe, block), work)
        for stream in streams:
            stream.synchronize()
        return time.perf_counter() - start
    finally:
        os.close(fd)
        torch.cuda.synchronize(device)
        for view in (v for pair in views for v in pair):
            view.release()


def _native_pipeline(path: str, nbytes: int, probe: Probe, dst: torch.Tensor) -> float:
    """``pipeline_read`` through the C loop of hot loads: each thread one call for its range,
    one pinned buffer, its own descriptor (readahead per thread), its blocks copied by address
    into the ring ``dst`` on a stream of its own. What the read engine's hot load does, without
    its plan, tensors and checksums."""
    ring, base = dst.numel(), dst.data_ptr()
    plans = _schedule(nbytes, probe, probe.block)
    pins = [torch.empty(probe.block, dtype=torch.uint8, pin_memory=True) for _ in plans]
    streams = [torch.cuda.Stream(dst.device) for _ in plans]
    stop = ctypes.c_int32(0)

    def work(t: int) -> None:
        torch.cuda.set_device(dst.device)  # the runtime queues copies through the thread's device
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            calls = engine_streams.DEVICES.native(streams[t], 1)
            assert calls is not None
            table = [(off, 0, min(length, nbytes - off), min(length, nbytes - off)) for off, length in plans[t]]
            at = [off % ring if off % ring + length <= ring else 0 for off, _, length, _ in table]
            parts = [[(0, base + a, length)] for a, (_, _, length, _) in zip(at, table, strict=True)]
            result = hotloop.run(fd, [pins[t].data_ptr()], calls, table, parts, stop)
            result.check(path, table[result.chunk], calls)
            streams[t].synchronize()
        finally:
            os.close(fd)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(plans), "bench-native") as pool:
        for f in [pool.submit(work, t) for t in range(len(plans)) if plans[t]]:
            f.result()
    return time.perf_counter() - start


def host_copy_rate(nbytes: int) -> float:
    """GB/s of a large memory copy in host memory, all cores (what a hot load into a GPU moves
    through host memory: page cache -> staging buffer, then the device reads the buffer)."""
    n = max(MiB, min(nbytes, 1 << 30))
    src = torch.empty(n, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return n / best / 1e9


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


def group_of(kind: str) -> str:
    """The job's thread counts that a sweep uses (an empty list: that sweep is not run)."""
    return "hot_threads" if kind in ("hot", "pipeline") else "threads"


def run_ceilings(job: Job, group: Group) -> dict[str, Any]:
    """Seconds of each probe of the raw write, cold read and hot read sweeps (``probes``),
    ``job["repeat"]`` times each, on all ranks at once; host memory's copy rate; and the pinned
    copy rates and the hot pipeline into it (``pipeline_read``) on a GPU. The report takes the
    best probe of each as the ceiling."""
    nbytes, cold = spec_of(job, group).nbytes(), Cold(job["cold"])
    os.makedirs(job["dir"], exist_ok=True)
    path = os.path.join(job["dir"], f"raw.rank{group.rank}")
    sweeps = {kind: probes(kind, job["threads"], job["hot_threads"], nbytes) if job[group_of(kind)] else []
              for kind in ("write", "read", "hot")}
    sweeps["pipeline"] = pipeline_probes(job["hot_threads"], nbytes) if group.cuda else []
    out: dict[str, Any] = {"bytes": nbytes, "block": block_for(nbytes), "resident": []}
    for kind, sweep in sweeps.items():
        out[kind] = {p.label: [] for p in sweep}

    def measure(kind: str, probe: Probe, fn: Callable[[], float]) -> None:
        group.barrier()
        seconds = fn()
        group.barrier()
        out[kind][probe.label].append(seconds)
        say(group, f"ceiling {kind}, {probe.label}: {short_number(nbytes / seconds / 1e9)} GB/s "
                   f"({short_number(seconds)} s)")

    def write(probe: Probe) -> float:
        seconds, direct = raw_write(path, nbytes, probe)
        out["direct"] = out.get("direct") or direct  # False where the file system refuses O_DIRECT
        return seconds

    def cold_read(probe: Probe) -> float:
        cache.evict(cold, [path], lead=group.lead)
        group.barrier()
        out["resident"].append(cache.resident_fraction([path]))
        return raw_read(path, nbytes, probe)

    try:
        for _ in range(job["repeat"]):
            for kind, fn in (("write", write), ("read", cold_read), ("hot", partial(raw_read, path, nbytes)),
                             ("pipeline", lambda p: pipeline_read(path, nbytes, p, group.device))):
                if kind in ("hot", "pipeline") and sweeps[kind]:  # fill the cache first
                    raw_read(path, nbytes, max(sweeps[kind], key=lambda p: p.threads))
                for probe in sweeps[kind]:
                    measure(kind, probe, partial(fn, probe))
        out["memory"] = host_copy_rate(nbytes)
        say(group, f"ceiling host memory copy: {out['memory']:.1f} GB/s")
        if group.cuda:
            out.update(copy=copy_rates(group.device, nbytes), gpu=torch.cuda.get_device_name(group.device),
                       gpus=torch.cuda.device_count())
            if out["copy"]:
                say(group, "ceiling copies (pinned): D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s".format(**out["copy"]))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return out
