"""Quick CUDA round trip and throughput check of the engine (one large tensor, same-run ceilings)."""

from __future__ import annotations

import os
import sys
import time

import torch

import ckptstream as cs


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_write(path: str, nbytes: int, block: int) -> float:
    import mmap

    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(1 << 20) * (block >> 20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    t = time.perf_counter()
    for off in range(0, nbytes, block):
        os.pwrite(fd, buf, off)
    os.fsync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    return dt


def raw_read(path: str, nbytes: int, block: int) -> float:
    import mmap

    buf = mmap.mmap(-1, block)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    t = time.perf_counter()
    for off in range(0, nbytes, block):
        os.preadv(fd, [buf], off)
    dt = time.perf_counter() - t
    os.close(fd)
    return dt


def main() -> None:
    d = sys.argv[1]
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 4
    p = os.path.join(d, "smoke.bin")
    # correctness on CUDA: split elements, non-contiguous
    for n, wb, rb in [(1025, 10000, 10000), (1025, 1024, 513), (125000, 10000, 10000)]:
        x = torch.randn(n, device="cuda")
        cs.device_to_file(x, p, buffer_size=wb)
        y = torch.full_like(x, float("nan"))
        cs.file_to_device(p, y, buffer_size=rb)
        assert torch.equal(x, y), (n, wb, rb)
    x = torch.randn(300, 700, device="cuda").t()[5:, ::3]
    cs.device_to_file(x, p, buffer_size=4096 * 3 + 5)
    y = torch.empty(x.shape[1], x.shape[0], device="cuda").t().fill_(float("nan"))
    cs.file_to_device(p, y, buffer_size=1000)
    assert torch.equal(x, y)
    print("correctness ok", flush=True)
    n = int(gib * (1 << 30))
    big = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    raw = os.path.join(d, "raw.bin")
    tw = raw_write(raw, n, 64 << 20)
    drop_caches()
    tr = raw_read(raw, n, 64 << 20)
    os.unlink(raw)
    t = time.perf_counter()
    cs.device_to_file(big, p)
    ts = time.perf_counter() - t
    cold = drop_caches()
    out = torch.empty_like(big)
    t = time.perf_counter()
    cs.file_to_device(p, out)
    torch.cuda.synchronize()
    tl = time.perf_counter() - t
    assert torch.equal(out, big)
    t = time.perf_counter()
    cs.file_to_device(p, out)
    torch.cuda.synchronize()
    th = time.perf_counter() - t
    print(f"{gib} GiB: raw O_DIRECT write {gbps(n, tw):.2f} GB/s, raw O_DIRECT read {gbps(n, tr):.2f}; "
          f"device_to_file {gbps(n, ts):.2f} ({ts and tw / ts:.2f}x), file_to_device {'cold' if cold else 'warm'} "
          f"{gbps(n, tl):.2f} ({tr / tl:.2f}x), hot {gbps(n, th):.2f}", flush=True)
    os.unlink(p)


if __name__ == "__main__":
    main()
