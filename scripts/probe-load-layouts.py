"""Cold and hot loads into the GPU, the engine's two read layouts taking turns (run by run, so
that the disk's drift falls on all alike): "before" (chunks taken in turn on the one
descriptor, whole-chunk reads) and "ranges" (one contiguous range per thread on a descriptor of
its own, readahead advised, 2 MiB read calls), at 8 and 16 I/O threads.
PYTHONPATH=src python scripts/probe-load-layouts.py"""
import os, statistics, time
import torch
import ckptstream
from ckptstream import Settings
from ckptstream._engine import engine as engine_mod, read as read_mod
from ckptstream._storage import files as files_mod
from ckptstream.bench.cache import fadvise_out
MiB, GiB = 1 << 20, 1 << 30
T0 = time.monotonic()
LIMIT = float(os.environ.get("PROBE_LIMIT", "120"))
def say(*a): print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)
D = os.environ.get("PROBE_DIR", "/tmp/probe"); os.makedirs(D, exist_ok=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
nt = int(float(os.environ.get("PROBE_GIB", "4")) * 16)
state = {f"t{i:03d}": torch.randn(16 * MiB, device=DEV) for i in range(nt)}
n = nt * 64 * MiB
path = os.path.join(D, "ckpt.safetensors"); ckptstream.save(state, path)
firsts = {k: state[k].clone() for k in ("t000", f"t{nt - 1:03d}")}; del state
new_claims, new_reader = read_mod.ReadEngine.claims, files_mod.FileSource.reader
def load(old, threads):
    read_mod.ReadEngine.claims = engine_mod.Engine.claims if old else new_claims
    files_mod.FileSource.reader = (lambda self: self) if old else new_reader
    s = Settings() if threads == 8 else Settings(buffer_size=8 * MiB, num_buffers=16, io_threads=16)
    try:
        torch.cuda.synchronize(); t = time.perf_counter()
        out = ckptstream.load(path, device=DEV, settings=s); torch.cuda.synchronize()
        dt = time.perf_counter() - t
    finally:
        read_mod.ReadEngine.claims, files_mod.FileSource.reader = new_claims, new_reader
    assert all(torch.equal(out[k], v) for k, v in firsts.items())
    return n / dt / 1e9
variants = [("before, 8 threads", True, 8), ("ranges, 8 threads", False, 8),
            ("before, 16 threads", True, 16), ("ranges, 16 threads", False, 16)]
for kind in ("cold", "hot"):
    got = {v[0]: [] for v in variants}
    for r in range(int(os.environ.get("PROBE_ROUNDS", "4"))):
        for name, old, th in variants:
            if time.monotonic() - T0 > LIMIT: break
            if kind == "cold": fadvise_out([path])
            got[name].append(load(old, th))
    for name, xs in got.items():
        if xs: say(f"{kind} {name:20s} median {statistics.median(xs):5.2f} GB/s  (" + " / ".join(f"{x:.2f}" for x in xs) + ")")
say("done")
