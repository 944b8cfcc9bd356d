"""Host memory of a save and of loads of a large GPT-like state on a GPU: the peak RSS growth of
each phase over its start (the kernel's high-water mark, bench/measure.py), beside the staging
it uses, with the rates. The first save and load of the process allocate the staging; the peak
counts it. Run from the repository root on a GPU machine (the file takes RSS_GIB of disk, and
as much of the page cache for the hot loads): RSS_GIB=40 PYTHONPATH=src python
scripts/rss-large-state.py [folder]. RSS_DEVICE=cpu tries it on a machine without a GPU (a
load into host memory then grows the RSS by the state itself)."""
import os, sys, time
import torch
import ckptstream
from ckptstream.bench.ceilings import Probe, raw_read
from ckptstream.bench.measure import PeakRss, timed
from ckptstream.bench.state import StateSpec, build_state, state_nbytes

MiB, GiB = 1 << 20, 1 << 30
T0 = time.monotonic()
folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rss-large"
os.makedirs(folder, exist_ok=True)
path = os.path.join(folder, "state.safetensors")
settings = ckptstream.Settings()
DEVICE = os.environ.get("RSS_DEVICE", "cuda")
staging = settings.buffer_size * settings.num_buffers


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def phase(name, fn, nbytes):
    with PeakRss() as rss:
        seconds, out = timed(fn, DEVICE)
    say(f"{name:28s} {nbytes / seconds / 1e9:6.2f} GB/s  peak RSS growth {rss.growth / MiB:8.1f} MiB "
        f"({rss.method}; the bound, staging + 64 MiB = {(staging + 64 * MiB) / MiB:.0f} MiB: "
        f"{'met' if rss.growth <= staging + 64 * MiB else 'MISSED'})")
    return out


def evict():
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


state = build_state(StateSpec(size_bytes=int(float(os.environ.get("RSS_GIB", "40")) * GiB)), DEVICE)
n = state_nbytes(state)
say(f"state {n / GiB:.2f} GiB on {DEVICE}; RSS {open('/proc/self/statm').read().split()[1]} pages")
phase("save", lambda: ckptstream.save(state, path), n)  # once: a second would need room for two files
evict()
out = phase("load, cold", lambda: ckptstream.load(path, device=DEVICE), n)
del out
if DEVICE == "cuda":
    torch.cuda.empty_cache()
raw_read(path, os.path.getsize(path), Probe("ranges", 16, 8 * MiB))  # into the page cache, untimed
out = phase("load, hot", lambda: ckptstream.load(path, device=DEVICE), n)
del out
if DEVICE == "cuda":
    torch.cuda.empty_cache()
phase("load_into, hot", lambda: ckptstream.load_into(state, path), n)
os.remove(path)
say("done")
