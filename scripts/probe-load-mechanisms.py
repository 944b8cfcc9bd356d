"""The read mechanisms a load could use, cold and hot, beside ckptstream's loads, all in turns in
one process on the same file (a GPT-like state saved by ckptstream): threads reading O_DIRECT
blocks, threads reading buffered contiguous ranges with readahead advised (the benchmark's
ceilings), io_uring (probe_uring.c: raw system calls, IOSQE_ASYNC, fixed buffers; with and
without O_DIRECT), kvikio's `CuFile.pread` straight into device memory (its thread pool, POSIX
reads into pinned bounce buffers, or GPUDirect Storage where present), and ckptstream.load into
the GPU and into host memory (mmap=False), checksums verified. Every figure is printed as it is
measured. Run from the repository root on a GPU machine: PYTHONPATH=src python
scripts/probe-load-mechanisms.py (PROBE_GIB sets the state's size, PROBE_ROUNDS the rounds,
PROBE_ONLY=word,word the variants whose names hold one of the words)."""
import ctypes, os, statistics, subprocess, sys, time
import torch
import ckptstream
from ckptstream.bench.ceilings import Probe, raw_read
from ckptstream.bench.state import StateSpec, build_state

MiB, GiB = 1 << 20, 1 << 30
T0, LIMIT = time.monotonic(), float(os.environ.get("PROBE_LIMIT", "200"))
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "3"))
D = os.environ.get("PROBE_DIR", "/tmp/probe-mechanisms"); os.makedirs(D, exist_ok=True)
PATH = os.path.join(D, "gpt.safetensors")
HERE = os.path.dirname(os.path.abspath(__file__))
GPU = torch.cuda.is_available()


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def uring_library():
    out = os.path.join(D, "probe_uring.so")
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", out, os.path.join(HERE, "probe_uring.c")], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        say("no C compiler here:", e)
        out = os.environ.get("PROBE_URING_SO", "")
    lib = ctypes.CDLL(out)
    lib.uring_read.restype = ctypes.c_int64
    lib.uring_read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    return lib


def evict():
    fd = os.open(PATH, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def warm():
    with open(PATH, "rb") as f:
        while f.read(64 * MiB):
            pass


spec = StateSpec(size_bytes=int(float(os.environ.get("PROBE_GIB", "4")) * GiB))
say(spec.summary())
state = build_state(spec, "cuda" if GPU else "cpu")
ckptstream.save(state, PATH)
del state
SIZE = os.path.getsize(PATH)
say(f"file {SIZE / GiB:.2f} GiB")
lib = uring_library()
_pools = {}


def uring(depth, block, direct, fixed=True, asynchronous=True):
    """Reads the file's first whole blocks (all but the tail under one block)."""
    key = (depth, block)
    if key not in _pools:  # pinned, as a load's staging is, and kept as a pool is
        _pools[key] = torch.empty(depth * block + 4096, dtype=torch.uint8, pin_memory=GPU)
    pool, info = _pools[key], (ctypes.c_int64 * 2)()
    base = -(-pool.data_ptr() // 4096) * 4096  # O_DIRECT reads into page-aligned memory
    total = SIZE // block * block
    fd = os.open(PATH, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t = time.perf_counter()
        n = lib.uring_read(fd, base, depth, block, total, int(fixed), int(asynchronous), info)
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
    if n != total:
        raise OSError(f"io_uring read {n} of {total} bytes" + (f" ({os.strerror(-n)})" if n < 0 else ""))
    if fixed and not info[0]:
        say("io_uring: buffers not registered; plain reads")
    return total / dt / 1e9


def threads(how, count, block):
    return SIZE / raw_read(PATH, SIZE, Probe(how, count, block)) / 1e9


def load(device, mmap=None, checksum=True):
    kw = {} if mmap is None else {"mmap": mmap}
    if GPU:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = ckptstream.load(PATH, device=device, checksum=checksum, **kw)
    if GPU:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del out
    return SIZE / dt / 1e9


def kvikio_variant():
    try:
        import kvikio
        import kvikio.defaults
    except Exception as e:  # noqa: BLE001
        say("kvikio not usable:", repr(e)[:300])
        return None
    say(f"kvikio {kvikio.__version__}: compat mode {kvikio.defaults.is_compat_mode_preferred()}, "
        f"{kvikio.defaults.get('num_threads')} threads, task {kvikio.defaults.get('task_size') >> 20} MiB")
    kvikio.defaults.set({"num_threads": 16, "task_size": 16 * MiB})
    dst = torch.empty(SIZE, dtype=torch.uint8, device="cuda")

    def read():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with kvikio.CuFile(PATH, "r") as f:
            n = f.pread(dst).get()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        if n != SIZE:
            raise OSError(f"kvikio read {n} of {SIZE}")
        return SIZE / dt / 1e9
    return read


def variants(cold):
    v = {
        "threads O_DIRECT 16 x 8 MiB": lambda: threads("direct", 16, 8 * MiB),
        "threads buffered ranges 16 x 2 MiB": lambda: threads("ranges", 16, 2 * MiB),
        "io_uring O_DIRECT 32 x 8 MiB": lambda: uring(32, 8 * MiB, True),
        "io_uring O_DIRECT 64 x 2 MiB": lambda: uring(64, 2 * MiB, True),
        "io_uring buffered async 12 x 8 MiB": lambda: uring(12, 8 * MiB, False),
        "io_uring buffered async 32 x 8 MiB": lambda: uring(32, 8 * MiB, False),
        "io_uring buffered 12 x 8 MiB, not async": lambda: uring(12, 8 * MiB, False, asynchronous=False),
        "ckptstream.load to CPU, mmap=False": lambda: load("cpu", mmap=False),
    }
    if not cold:
        v["threads buffered blocks 16 x 8 MiB"] = lambda: threads("buffered", 16, 8 * MiB)
        v.pop("io_uring O_DIRECT 64 x 2 MiB")
    if GPU:
        v["ckptstream.load to GPU"] = lambda: load("cuda")
        v["ckptstream.load to GPU, checksum=False"] = lambda: load("cuda", checksum=False)
        if (kv := kvikio_variant()) is not None:
            v["kvikio CuFile.pread to GPU, 16 threads x 16 MiB"] = kv
    return v


def run(cold):
    table = variants(cold)
    if only := [w for w in os.environ.get("PROBE_ONLY", "").split(",") if w]:  # e.g. PROBE_ONLY=kvikio,ranges
        table = {name: fn for name, fn in table.items() if any(w in name for w in only)}
    got = {name: [] for name in table}
    say(("cold" if cold else "hot") + f" reads of {SIZE / GiB:.2f} GiB, GB/s, {ROUNDS} rounds in turns")
    if not cold:
        warm()
        for name, fn in table.items():  # warm what a training run warms once (pools, kernels)
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                say(f"{name}: failed {e!r}"[:300])
    for r in range(ROUNDS):
        for name, fn in table.items():
            if time.monotonic() - T0 > LIMIT:
                say("time limit")
                return got
            if cold:
                evict()
            try:
                got[name].append(fn())
                say(f"  round {r + 1} {name}: {got[name][-1]:.2f}")
            except Exception as e:  # noqa: BLE001
                say(f"{name}: failed {e!r}"[:300])
    return got


def summary(label, got):
    say(label)
    for name, xs in got.items():
        if xs:
            say(f"  {name:50s} median {statistics.median(xs):6.2f}  (" + " / ".join(f"{x:.2f}" for x in xs) + ")")


hot = run(cold=False)
summary("hot, medians", hot)
cold = run(cold=True)
summary("cold, medians", cold)
say("done")
sys.exit(0)
