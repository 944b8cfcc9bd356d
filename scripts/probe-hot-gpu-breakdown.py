"""Where a hot load of the benchmark's GPT-like state into a GPU spends its time: per I/O thread,
the reads from the page cache, the copy launches, the waits for a staging buffer's copies, the
host checksums, and the device checksums at the end; under several staging shapes, beside the
bare pipeline on the same file (run from the repository root on a GPU machine:
PYTHONPATH=src python scripts/probe-hot-gpu-breakdown.py; PROBE_GIB sets the state's size; one
run: docs/results/probe-hot-gpu-breakdown-h200.txt)."""
import collections, os, threading, time
import torch
import ckptstream
from ckptstream import Settings
from ckptstream._engine import read as readmod
from ckptstream.bench.ceilings import Probe, pipeline_read
from ckptstream.bench.state import StateSpec, build_state, flat_tensors

MiB, GiB = 1 << 20, 1 << 30
T0, LIMIT = time.monotonic(), float(os.environ.get("PROBE_LIMIT", "240"))
D = os.environ.get("PROBE_DIR", "/tmp/probe-breakdown"); os.makedirs(D, exist_ok=True)
PATH = os.path.join(D, "gpt.safetensors")


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


spent = collections.defaultdict(float)  # phase -> seconds, summed over the threads
lock = threading.Lock()


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                spent[name] += time.perf_counter() - t
    return wrapper


E = readmod.ReadEngine
for name in ("_read", "_copy_parts", "_chunk_crcs", "_result", "_move", "__init__"):
    setattr(E, name, timed(name, getattr(E, name)))

spec = StateSpec(size_bytes=int(float(os.environ.get("PROBE_GIB", "8")) * GiB))
say(spec.summary())
state = build_state(spec, "cuda")
torch.cuda.synchronize()
ckptstream.save(state, PATH)
ref = flat_tensors(state)
N = sum(t.numel() * t.element_size() for t in ref.values())
del state
size = os.path.getsize(PATH)
fd = os.open(PATH, os.O_RDONLY); mv = memoryview(bytearray(64 * MiB))
for off in range(0, size, 64 * MiB):
    os.preadv(fd, [mv], off)  # into the page cache
os.close(fd)
say(f"saved {N / GiB:.2f} GiB, file {size / GiB:.2f} GiB")


def load(s, checksum=True, check=False):
    spent.clear()
    torch.cuda.synchronize(); t = time.perf_counter()
    out = ckptstream.load(PATH, device="cuda", settings=s, checksum=checksum)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    if check:
        got = flat_tensors(out)
        assert all(torch.equal(got[k], v) for k, v in ref.items()), "differs"
    del out
    return N / dt / 1e9, dt, dict(spent)


def show(name, runs):
    rates = " / ".join(f"{r:.1f}" for r, _, _ in runs)
    _, dt, sp = runs[-1]
    move = sp.get("_move", 0)
    wait = move - sp.get("_read", 0) - sp.get("_copy_parts", 0) - sp.get("_chunk_crcs", 0)
    say(f"{name:34s} {rates} GB/s | last {dt * 1e3:.0f} ms: init {sp.get('__init__', 0) * 1e3:.0f}, "
        f"thread-sum read {sp.get('_read', 0) * 1e3:.0f} launch {sp.get('_copy_parts', 0) * 1e3:.0f} "
        f"crc {sp.get('_chunk_crcs', 0) * 1e3:.0f} wait {wait * 1e3:.0f}, device crcs {sp.get('_result', 0) * 1e3:.0f}")


load(None, check=True)  # warm: pinned pool, allocator, and the bytes checked once
variants = [("default (16MiB x 8, 8 thr)", None, True), ("default, checksum=False", None, False)] + [
    (f"{b}MiB x {n}, {th} thr", Settings(buffer_size=b * MiB, num_buffers=n, io_threads=th), True)
    for b, n, th in ((8, 16, 8), (16, 16, 8), (4, 32, 16), (8, 32, 16), (16, 32, 16), (32, 16, 8), (64, 32, 16))]
for name, s, checksum in variants:
    if time.monotonic() - T0 > LIMIT:
        say("time"); break
    try:
        load(s, checksum)
        show(name, [load(s, checksum) for _ in range(3)])
    except Exception as e:
        say(name, "failed", repr(e))
for threads, block in ((8, 16 * MiB), (16, 16 * MiB), (8, 8 * MiB), (16, 64 * MiB)):
    if time.monotonic() - T0 > LIMIT:
        say("time"); break
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    rates = [size / pipeline_read(PATH, size, Probe("pinned", threads, block), "cuda", dst) / 1e9 for _ in range(3)]
    say(f"bare pipeline {threads} thr x 2 x {block >> 20} MiB: " + " / ".join(f"{r:.1f}" for r in rates) + " GB/s")
    del dst
say("done")
