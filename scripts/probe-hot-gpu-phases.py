"""Where a hot load into one GPU spends its time, phase by phase, against a bare copy loop: the
read engine's set-up (header, allocations, plan), its threads' start, the first and the last
chunk moved, the device checksums and the hand-back, timed inside one process for the engine
as it is, with its I/O threads started without the gate (each start then waits for the new
thread to take the interpreter lock behind the running ones), without checksums, and with a
shorter interpreter switch interval; beside the bare loop of probe-hot-gpu-variants.py. Run
from the repository root on a GPU machine: PYTHONPATH=src python scripts/probe-hot-gpu-phases.py."""
import os, runpy, statistics, sys, threading, time
import torch
import ckptstream
from ckptstream._engine import engine as engine_mod, read as read_mod


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
GATE = [True]


def init(self, *a, **k):
    mark("setup done")
    Init(self, *a, **k)
    if not GATE[0]:
        self._go.set()  # as before the gate: each thread runs as soon as it starts
    mark("engine made")


def start(self):
    r = Start(self)
    mark("threads started")
    return r


def move(self, chunk, buf):
    mark("first chunk")
    Move(self, chunk, buf)
    mark("last chunk", first=False)


def result(self):
    mark("checksums begin")
    r = Result(self)
    mark("checksums done")
    return r


engine_mod.Engine.__init__, engine_mod.Engine.start = init, start
read_mod.ReadEngine._move, read_mod.ReadEngine._result = move, result


def load(checksum=True, gate=True, switch=None):
    GATE[0] = gate
    old = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(switch)
    try:
        marks.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = ckptstream.load(PATH, device="cuda", checksum=checksum)
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        sys.setswitchinterval(old)
    del out
    order = ["setup done", "engine made", "threads started", "first chunk", "last chunk", "checksums begin",
             "checksums done"]
    at, phases = t, {}
    for name in order:
        if name in marks:
            phases[name] = (marks[name] - at) * 1e3
            at = marks[name]
    phases["returned"] = (end - at) * 1e3
    return N / (end - t) / 1e9, phases


variants = {"engine": lambda: load(), "engine, no start gate": lambda: load(gate=False),
            "engine, checksum=False": lambda: load(checksum=False),
            "engine, switch interval 0.5 ms": lambda: load(switch=0.0005)}
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
    rates = [r for r, _ in runs]
    keys = runs[0][1].keys()
    med = {k: statistics.median(p[k] for _, p in runs if k in p) for k in keys}
    say(f"{name:32s} median {statistics.median(rates):5.1f} GB/s (" + " / ".join(f"{x:.1f}" for x in rates) + ")")
    say("    ms after the previous mark: " + ", ".join(f"{k} {x:.1f}" for k, x in med.items()))
say("done")
