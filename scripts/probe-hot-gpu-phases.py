"""Where a hot load into one GPU spends its time, phase by phase, against a bare copy loop: the
read engine's set-up (header, allocations, plan), its threads' start, the first and the last
chunk moved, the device checksums and the hand-back, timed inside one process, with and without
checksums; and, summed over the I/O threads, the time in reads, in queueing copies, in host
checksums and the rest of a chunk's turn (mostly waiting for a staging buffer's copies). Beside
the bare loop of probe-hot-gpu-variants.py. Run from the repository root on a GPU machine:
PYTHONPATH=src python scripts/probe-hot-gpu-phases.py."""
import os, runpy, statistics, threading, time
import torch
import ckptstream
from ckptstream._engine import engine as engine_mod, read as read_mod, streams as streams_mod


here = os.path.dirname(os.path.abspath(__file__))
v = runpy.run_path(os.path.join(here, "probe-hot-gpu-variants.py"), run_name="variants")
say, PATH, N, bare, T0 = v["say"], v["PATH"], v["N"], v["bare"], v["T0"]
ROUNDS, LIMIT = int(os.environ.get("PHASE_ROUNDS", "5")), float(os.environ.get("PHASE_LIMIT", "90"))

marks: dict[str, float] = {}
lock = threading.Lock()


def mark(name, first=True):
    t = time.perf_counter()
    with lock:
        if first and name in marks:
            return
        marks[name] = t


Init, Start, Move, Result = (engine_mod.Engine.__init__, engine_mod.Engine.start, read_mod.ReadEngine._move,
                             read_mod.ReadEngine._result)
spent: dict[str, float] = {}  # seconds, summed over the I/O threads


def timed(name, fn):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            with lock:
                spent[name] = spent.get(name, 0.0) + dt
    return run


def init(self, *a, **k):
    mark("setup done")
    Init(self, *a, **k)
    mark("engine made")


def start(self):
    r = Start(self)
    mark("threads started")
    return r


def move(self, chunk, buf):
    mark("first chunk")
    timed("chunk turns", Move)(self, chunk, buf)
    mark("last chunk", first=False)


def result(self):
    mark("checksums begin")
    r = Result(self)
    mark("checksums done")
    return r


engine_mod.Engine.__init__, engine_mod.Engine.start = init, start
read_mod.ReadEngine._move, read_mod.ReadEngine._result = move, result
for name, attr in (("reads", "_read"), ("queueing copies", "_copy_parts"), ("host checksums", "_chunk_crcs")):
    setattr(read_mod.ReadEngine, attr, timed(name, getattr(read_mod.ReadEngine, attr)))


def load(checksum=True, on_host=False):
    """on_host: checksums of the staging buffers on the host, none on the device."""
    marks.clear()
    spent.clear()
    devices = streams_mod.CudaDevices
    saved = devices.checksums_on_device, devices.span_checksums_on_device
    if on_host:
        devices.checksums_on_device = devices.span_checksums_on_device = lambda self, *a: False
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = ckptstream.load(PATH, device="cuda", checksum=checksum)
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        devices.checksums_on_device, devices.span_checksums_on_device = saved
    del out
    order = ["setup done", "engine made", "threads started", "first chunk", "last chunk", "checksums begin",
             "checksums done"]
    at, phases = t, {}
    for name in order:
        if name in marks:
            phases[name] = (marks[name] - at) * 1e3
            at = marks[name]
    phases["returned"] = (end - at) * 1e3
    turns = spent.pop("chunk turns", 0.0)
    threads = {k: x * 1e3 for k, x in spent.items()}
    threads["rest of the turns"] = turns * 1e3 - sum(threads.values())
    return N / (end - t) / 1e9, phases, threads


variants = {"engine": lambda: load(), "engine, checksum=False": lambda: load(checksum=False),
            "engine, checksums on the host": lambda: load(on_host=True)}
for fn in variants.values():
    fn()
got = {name: [] for name in variants}
bares = []
for r in range(ROUNDS):
    if time.monotonic() - T0 > LIMIT:
        say("time"); break
    for name, fn in variants.items():
        got[name].append(fn())
    bares.append(bare(16, 1, 8 * v["MiB"])[0])
say(f"bare 16 x 1 x 8 MiB: median {statistics.median(bares):.1f} GB/s (" + " / ".join(f"{x:.1f}" for x in bares) + ")")
for name, runs in got.items():
    rates = [r for r, _, _ in runs]
    say(f"{name:32s} median {statistics.median(rates):5.1f} GB/s (" + " / ".join(f"{x:.1f}" for x in rates) + ")")
    for what, at in (("ms after the previous mark", 1), ("ms summed over the I/O threads", 2)):
        med = {k: statistics.median(r[at][k] for r in runs if k in r[at]) for k in runs[0][at]}
        say(f"    {what}: " + ", ".join(f"{k} {x:.1f}" for k, x in med.items()))
say("done")
