"""The machine's ceilings for checkpoint I/O, each mechanism on its own, printed as it goes (a GPU
machine: PROBE_GIB=4 python scripts/probe-io-mechanisms.py). The mechanisms:
O_DIRECT and buffered blocks, one readahead range per thread, host memory copies, pinned H2D, and
the bare preadv -> pinned -> H2D pipeline of Python threads."""
import ctypes, mmap, os, sys, threading, time
import torch
MiB = 1 << 20
GiB = 1 << 30
D = os.environ.get("PROBE_DIR", "/tmp/probe"); os.makedirs(D, exist_ok=True)
N = int(os.environ.get("PROBE_GIB", "4")) * GiB
PATH = os.path.join(D, "f.bin")
T0 = time.monotonic(); LIMIT = float(os.environ.get("PROBE_LIMIT", "400"))
def say(*a): print(f"[{time.monotonic()-T0:6.1f}s]", *a, flush=True)
def left(): return LIMIT - (time.monotonic() - T0)
def aligned(n):
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
def par(threads, fn):
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(threads)]
    t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; return time.perf_counter() - t
def evict():
    fd = os.open(PATH, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def write(threads, block, direct):
    flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(PATH, flags, 0o644); os.ftruncate(fd, N)
    bufs = [aligned(block) for _ in range(threads)]
    for b in bufs: b.write(os.urandom(1 << 16) * (block >> 16)); b.seek(0)
    nblk = N // block
    def w(i):
        for k in range(i, nblk, threads): os.pwrite(fd, bufs[i], k * block)
    t = time.perf_counter(); par(threads, w); os.fsync(fd); dt = time.perf_counter() - t
    os.close(fd); [b.close() for b in bufs]; return N / dt / 1e9
def read_blocks(threads, block, direct, cold):
    if cold: evict()
    fd = os.open(PATH, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    bufs = [aligned(block) for _ in range(threads)]; nblk = N // block
    def r(i):
        for k in range(i, nblk, threads): os.preadv(fd, [bufs[i]], k * block)
    dt = par(threads, r); os.close(fd); [b.close() for b in bufs]; return N / dt / 1e9
def read_ranges(threads, io, cold):
    """Each thread reads one contiguous range sequentially, buffered, with readahead advice."""
    if cold: evict()
    fd = os.open(PATH, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    bufs = [aligned(io) for _ in range(threads)]; span = N // threads
    def r(i):
        for off in range(i * span, (i + 1) * span, io): os.preadv(fd, [bufs[i]], off)
    dt = par(threads, r); os.close(fd); [b.close() for b in bufs]; return N / dt / 1e9
def memcpy(threads):
    torch.set_num_threads(threads)
    a = torch.empty(GiB, dtype=torch.uint8); a.fill_(7); b = torch.empty_like(a); b.copy_(a)
    t = time.perf_counter()
    for _ in range(3): b.copy_(a)
    dt = time.perf_counter() - t; torch.set_num_threads(os.cpu_count()); return 3 * GiB / dt / 1e9
def h2d(chunk):
    src = torch.empty(chunk, dtype=torch.uint8, pin_memory=True); dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); n = max(1, 4 * GiB // chunk)
    t = time.perf_counter()
    for _ in range(n): dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(); return n * chunk / (time.perf_counter() - t) / 1e9
def pipeline(threads, chunk, ranges):
    """preadv into a thread's two pinned buffers, then H2D on the thread's stream (hot)."""
    fd = os.open(PATH, os.O_RDONLY)
    dst = torch.empty(N, dtype=torch.uint8, device="cuda")
    pins = [[torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)] for _ in range(threads)]
    streams = [torch.cuda.Stream() for _ in range(threads)]
    nblk = N // chunk; span = nblk // threads
    def r(i):
        ev = [None, None]; ks = range(i * span, (i + 1) * span) if ranges else range(i, nblk, threads)
        for j, k in enumerate(ks):
            s = j % 2
            if ev[s] is not None: ev[s].synchronize()
            p = pins[i][s]; os.preadv(fd, [memoryview(p.numpy())], k * chunk)
            with torch.cuda.stream(streams[i]):
                dst[k * chunk:(k + 1) * chunk].copy_(p, non_blocking=True); e = torch.cuda.Event(); e.record(); ev[s] = e
        torch.cuda.synchronize()
    dt = par(threads, r); os.close(fd); del dst; return N / dt / 1e9
def best(name, runs):
    out = []
    for label, fn in runs:
        if left() < 20: say(name, label, "skipped: time"); continue
        try: v = fn()
        except Exception as e: say(name, label, "failed", repr(e)); continue
        out.append((v, label)); say(f"{name:12s} {label:28s} {v:6.2f} GB/s")
    if out: say(f"BEST {name}: {max(out)[0]:.2f} GB/s by {max(out)[1]}")
say("torch", torch.__version__, "cpus", os.cpu_count(), "file", N / GiB, "GiB in", D)
try: say("io_uring_disabled =", open("/proc/sys/kernel/io_uring_disabled").read().strip())
except OSError as e: say("io_uring_disabled: n/a", e)
libc = ctypes.CDLL(None, use_errno=True); params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 8, params); say("io_uring_setup:", fd, os.strerror(ctypes.get_errno()) if fd < 0 else "ok")
if fd >= 0: os.close(fd)
best("memcpy", [(f"{t} threads 1 GiB", lambda t=t: memcpy(t)) for t in (1, 4, 8, 16)])
if torch.cuda.is_available():
    best("h2d pinned", [(f"{c >> 20} MiB", lambda c=c: h2d(c)) for c in (8 * MiB, 64 * MiB)])
best("write", [(f"odirect {t}x{b >> 20}MiB", lambda t=t, b=b: write(t, b, True)) for t, b in
               ((1, 64 * MiB), (4, 16 * MiB), (8, 8 * MiB), (16, 8 * MiB), (4, 64 * MiB))] +
     [("buffered 4x16MiB", lambda: write(4, 16 * MiB, False))])
write(8, 8 * MiB, True)
best("cold read", [(f"odirect {t}x{b >> 20}MiB", lambda t=t, b=b: read_blocks(t, b, True, True)) for t, b in
                   ((4, 64 * MiB), (16, 8 * MiB), (32, 4 * MiB), (64, 2 * MiB), (16, 1 * MiB))] +
     [(f"ranges {t}x2MiB", lambda t=t: read_ranges(t, 2 * MiB, True)) for t in (8, 16, 32)] +
     [("buffered blocks 16x8MiB", lambda: read_blocks(16, 8 * MiB, False, True))])
read_blocks(16, 8 * MiB, False, False)
best("hot read", [(f"blocks {t}x{b >> 20}MiB", lambda t=t, b=b: read_blocks(t, b, False, False)) for t, b in
                  ((4, 16 * MiB), (8, 8 * MiB), (8, 16 * MiB), (16, 8 * MiB), (32, 4 * MiB))] +
     [(f"ranges {t}x2MiB", lambda t=t: read_ranges(t, 2 * MiB, False)) for t in (8, 16)])
if torch.cuda.is_available():
    best("hot gpu pipe", [(f"{'ranges' if r else 'blocks'} {t}x{c >> 20}MiB", lambda t=t, c=c, r=r: pipeline(t, c, r))
                          for t, c, r in ((8, 16 * MiB, False), (16, 8 * MiB, False), (8, 16 * MiB, True), (12, 8 * MiB, False))])
say("done")
