"""Ways to read and checksum a hot file into staging buffers (and on to the GPU), compared.

    python benchmarks/read_probe.py FILE [THREADS]   (FILE hot in the page cache)

Each variant moves the whole file through one 16 MiB staging buffer per thread; with a GPU,
each filled buffer is copied to the device as in a load (and, in the "crc-after-enqueue" rows,
checksummed while the device reads it, as loads do). Variants take turns, 3 rounds; the mapping
is torn down after the clock stops. Results: docs/results/read-probe.txt.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import crc32c
import torch

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
MADV_POPULATE_READ = 22
CHUNK = 16 << 20
CUDA = torch.cuda.is_available()


class Buf:
    def __init__(self) -> None:
        self.map = mmap.mmap(-1, CHUNK)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        self.view = memoryview((ctypes.c_char * CHUNK).from_address(self.ptr)).cast("B")
        if CUDA:
            torch.cuda.cudart().cudaHostRegister(self.ptr, CHUNK, 1)
        self.event: torch.cuda.Event | None = None


def run(path: str, threads: int, fill: Callable[[int, int, int, Buf, int], None], device: bool,
        after_enqueue: Callable[[Buf, int], None]) -> float:
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    nchunks = (size + CHUNK - 1) // CHUNK
    counter = iter(range(nchunks))
    lock = threading.Lock()
    dst = torch.empty(CHUNK * threads, dtype=torch.uint8, device="cuda") if device else None
    if CUDA:
        torch.cuda.synchronize()

    def worker(i: int) -> None:
        buf = BUFS[i]
        stream = torch.cuda.Stream() if device else None
        while True:
            with lock:
                c = next(counter, None)
            if c is None:
                break
            if buf.event is not None:
                buf.event.synchronize()
            n = min(CHUNK, size - c * CHUNK)
            fill(fd, addr, c * CHUNK, buf, n)
            if device:
                assert stream is not None and dst is not None
                with torch.cuda.stream(stream):
                    dst[i * CHUNK : i * CHUNK + n].copy_(buf.tensor[:n], non_blocking=True)
                    buf.event = torch.cuda.Event(blocking=True)
                    buf.event.record(stream)
                after_enqueue(buf, n)
        if buf.event is not None:
            buf.event.synchronize()
            buf.event = None

    t = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    elapsed = time.perf_counter() - t
    libc.munmap(addr, size)
    os.close(fd)
    return size / elapsed / 1e9


def pread(fd: int, addr: int, off: int, buf: Buf, n: int) -> None:
    os.preadv(fd, [buf.view[:n]], off)


def pread_crc(fd: int, addr: int, off: int, buf: Buf, n: int) -> None:
    os.preadv(fd, [buf.view[:n]], off)
    crc32c.crc32c(buf.view[:n])


def pread_blocks_crc(block: int) -> Callable[..., None]:
    def fill(fd: int, addr: int, off: int, buf: Buf, n: int) -> None:
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            os.preadv(fd, [buf.view[lo:hi]], off + lo)
            crc32c.crc32c(buf.view[lo:hi])
    return fill


def mmap_copy(block: int, crc: bool, populate: bool) -> Callable[..., None]:
    def fill(fd: int, addr: int, off: int, buf: Buf, n: int) -> None:
        if populate:
            libc.madvise(addr + off, n, MADV_POPULATE_READ)
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            ctypes.memmove(buf.ptr + lo, addr + off + lo, hi - lo)
            if crc:
                crc32c.crc32c(buf.view[lo:hi])
    return fill


def mincore_then_pread(fd: int, addr: int, off: int, buf: Buf, n: int) -> None:
    vec = ctypes.create_string_buffer((n + 4095) // 4096)
    libc.mincore(addr + off, n, vec)
    os.preadv(fd, [buf.view[:n]], off)


BUFS: list[Buf] = []


def main() -> None:
    path = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    BUFS.extend(Buf() for _ in range(threads))
    variants: dict[str, Callable[..., None]] = {
        "pread 16M": pread,
        "pread 16M + crc": pread_crc,
        "mincore + pread 16M": mincore_then_pread,
        "pread 2M blocks + crc": pread_blocks_crc(2 << 20),
        "mmap copy 16M": mmap_copy(16 << 20, False, False),
        "mmap populate + copy 16M": mmap_copy(16 << 20, False, True),
        "mmap populate + copy 16M + crc": mmap_copy(16 << 20, True, True),
        "mmap copy+crc 256K blocks": mmap_copy(256 << 10, True, False),
        "mmap populate + copy+crc 256K": mmap_copy(256 << 10, True, True),
        "mmap populate + copy+crc 1M": mmap_copy(1 << 20, True, True),
        "mmap populate + copy+crc 4M": mmap_copy(4 << 20, True, True),
    }
    modes = [False, True] if CUDA else [False]
    results: dict[tuple[str, bool, str], list[float]] = {}
    for rnd in range(3):
        for device in modes:
            for name, fill in variants.items():
                for post_name, post in (("", lambda b, n: None), (" crc-after-enqueue", lambda b, n: crc32c.crc32c(b.view[:n]))):
                    if post_name and not (device and name in ("pread 16M", "mmap populate + copy 16M")):
                        continue
                    results.setdefault((name, device, post_name), []).append(run(path, threads, fill, device, post))
        print(f"round {rnd} done", flush=True)
    for (name, device, post_name), rates in results.items():
        print(f"{threads} thr {'H2D ' if device else 'host'} {name + post_name:42}: median {statistics.median(rates):6.2f} "
              f"GB/s  ({' '.join(f'{r:.2f}' for r in rates)})", flush=True)


if __name__ == "__main__":
    main()
