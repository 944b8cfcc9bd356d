"""What a training loop feels of a checkpoint: the stall benchmark.

A GPT-like loop (bf16 weights, fp32 master weights and AdamW on the GPU; fp32 on the CPU) sized
so that its state (weights, master weights, both moments) is ``size_gib``. For each system, in a
process of its own, per checkpoint: the wall time of N training steps without a checkpoint, then
of the same N steps with one checkpoint taken at the first step boundary, the wait for the file
to be durable after the last step included. N is the same for every system of a run, chosen so
that the slowest write ends inside the loop (each row says whether it did). Per checkpoint:

    lost      training time lost: the N steps with the checkpoint minus the N steps without; the sum of
    blocked   time the loop spends inside the save call and waiting before its next updates
    slowed    the steps' extra time while the save runs beside them (lost - blocked - waited)
    waited    the wait at the end for the file to be durable (0 when the write ended inside the loop)
    stall     how much longer the step that takes the checkpoint is than a plain step
    slowdown  median step time while the save is in flight, over the plain step time, minus 1
    GPU       extra GPU memory at the peak of the checkpoint (allocated by torch)
    RSS       peak host RSS over the process's before the checkpoint
    durable   seconds from the call until the checkpoint is on disk (fsynced)

While a checkpoint is in flight the loop calls the system's gate just before ``optimizer.step()``
(``handle.wait_staged()`` for save_async: "lazy" waits until the state is read, "host" makes the
update wait on the GPU for the copies into host memory, "device" returns at once; DCP's pinned
stager: its staging future), as a training loop does. Each step ends by synchronizing its own
stream (a device-wide synchronize would wait for the copies a save runs on its side streams).

Systems (``checkpointers.py``): ckptstream.save (sync), save_async in "device", "lazy" and "host"
modes, torch.save in a background thread after a CPU copy, DCP async_save with its default
stager and with torchtitan's pinned-memory stager; nvidia-resiliency-ext's async torch.save when
named.

    python -m ckptstream.bench.training --size-gib 8 --json stall.json
    result = training.run(8.0); print(training.render(result))      # from code
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import ckptstream

from .checkpointers import ALL_SYSTEMS, OURS, PEER_SYSTEMS, SYSTEMS, Start, session

__all__ = ["ALL_SYSTEMS", "OURS", "PEER_SYSTEMS", "SYSTEMS", "Loop", "auto_steps", "measure", "medians", "render",
           "run"]
WARMUP_STEPS, BASELINE_STEPS = 3, 8
MIN_STEPS = 8
# The automatic N covers a write of the state at this rate, below every way to checkpoint measured
# on the GPU machine (DCP's default async_save wrote at about 0.5 GB/s).
AUTO_WRITE_RATE = 0.4e9
MiB, GiB = 1 << 20, 1 << 30
_clock = time.perf_counter  # the checkpointers' ``durable_at`` readings are on the same clock
RATIOS_TO = ("dcp.async_save+pinned", "nvrx.async_save")  # the lost time of each row is compared with these


class Loop:
    """The training loop: an embedding and MLP blocks (most of a GPT's parameters and FLOPs)."""

    def __init__(self, size_bytes: int, device: torch.device) -> None:
        self.device, cuda = device, device.type == "cuda"
        per_param = 14 if cuda else 12  # bf16 + fp32 master + 2 fp32 moments; fp32 + 2 moments
        params = max(1, size_bytes // per_param)
        self.d = 2048 if params > 1 << 28 else 1024 if params > 1 << 25 else 256 if params > 1 << 21 else 64
        self.vocab = 8 * self.d
        self.layers = max(1, round((params - self.vocab * self.d) / (8 * self.d * self.d)))
        self.tokens = 8192 if cuda else 32
        dtype = torch.bfloat16 if cuda else torch.float32
        torch.manual_seed(0)
        self.wte = nn.Embedding(self.vocab, self.d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(self.d, 4 * self.d, bias=False), nn.GELU(),
                                                  nn.Linear(4 * self.d, self.d, bias=False))
                                    for _ in range(self.layers))
        self.model = nn.ModuleList([self.wte, self.blocks]).to(device, dtype)
        self.master = [p.detach().float().clone() for p in self.model.parameters()] if cuda else None
        self.params = self.master if self.master is not None else list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.idx = torch.randint(self.vocab, (self.tokens,), device=device)
        self.gate_s = 0.0

    def step(self, gate: Callable[[], None] | None = None) -> float:
        """One training step, its wall time (the GPU's work included); ``gate`` runs before the
        update (where a lazy save must be staged)."""
        start = _clock()
        x = self.wte(self.idx)
        for block in self.blocks:
            x = x + block(x)
        x.float().square().mean().backward()
        if self.master is not None:
            for m, p in zip(self.master, self.model.parameters(), strict=True):
                m.grad, p.grad = p.grad.float(), None  # type: ignore[union-attr]
        self.gate_s = 0.0
        if gate is not None:
            before = _clock()
            gate()
            self.gate_s = _clock() - before
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.model.parameters(), strict=True):
                    p.copy_(m)
        if self.device.type == "cuda":
            # the step's own stream, as a loop that reads its loss does: a device-wide
            # synchronize would also wait for a save's copies running on its side streams
            torch.cuda.current_stream(self.device).synchronize()
        return _clock() - start

    def state(self) -> dict[str, torch.Tensor]:
        """The training state as a flat dict of the live tensors (the same for every system)."""
        out: dict[str, torch.Tensor] = {f"model.{i}": p for i, p in enumerate(self.model.parameters())}
        for i, p in enumerate(self.params):
            if self.master is not None:
                out[f"master.{i}"] = p
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{i}"] = self.opt.state[p][k]
        return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _peak_rss() -> Iterator[list[int]]:
    """[base, peak] of the process's resident memory while the block runs (sampled every 2 ms)."""
    found, stop = [_rss(), _rss()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            found[1] = max(found[1], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield found
    finally:
        stop.set()
        sampler.join()
        found[1] = max(found[1], _rss())


def auto_steps(state_bytes: int, step_s: float) -> int:
    """N steps that outlast a write of the state at AUTO_WRITE_RATE."""
    return max(MIN_STEPS, math.ceil(state_bytes / AUTO_WRITE_RATE / step_s))


def _plain(loop: Loop, steps: int) -> tuple[float, list[float]]:
    """Wall time of ``steps`` plain steps, and each step's time. The RSS sampler runs here too, so
    that the runs with and without a checkpoint carry the same measuring."""
    with _peak_rss():
        began = _clock()
        times = [loop.step() for _ in range(steps)]
        return _clock() - began, times


def _checkpoint(begin: Start, loop: Loop, path: str, steps: int, without_s: float,
                base_step: float) -> dict[str, Any]:
    """The same ``steps`` steps with one checkpoint started before the first, and its figures."""
    cuda = loop.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated() if cuda else 0
    with _peak_rss() as rss:
        began = _clock()
        job = begin(loop.state(), path)
        called = _clock() - began
        gated, times, flying = 0.0, [], []
        for _ in range(steps):
            in_flight = not job.done()
            times.append(loop.step(job.gate if in_flight else None))
            gated += loop.gate_s
            flying.append(in_flight)
        loop_end = _clock()
        job.finish()
        ended = _clock()
    durable_at = job.durable_at()
    lost, waited, blocked = (ended - began) - without_s, ended - loop_end, called + gated
    during = [t for t, f in zip(times[1:], flying[1:], strict=True) if f]  # the first step holds the stall
    return {"lost_s": lost, "blocked_s": blocked, "slowed_s": lost - blocked - waited, "waited_s": waited,
            "stall_s": max(0.0, called + times[0] - base_step),
            "durable_s": None if durable_at is None else durable_at - began,
            "ended_inside": None if durable_at is None else durable_at <= loop_end,
            "slowdown": statistics.median(during) / base_step - 1 if during else None, "steps_in_flight": len(during),
            "extra_gpu_bytes": torch.cuda.max_memory_allocated() - gpu_before if cuda else 0,
            "peak_rss_bytes": rss[1] - rss[0]}


def _device(device: str) -> torch.device:
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")


def measure(system: str, size_gib: float, *, device: str = "auto", directory: str | None = None,
            checkpoints: int = 2, steps: int | None = None) -> dict[str, Any]:
    """Measure one system in this process (see the module); a JSON-able dict. ``steps`` None:
    ``auto_steps`` from this process's plain step time."""
    dev = _device(device)
    loop = Loop(int(size_gib * GiB), dev)
    for _ in range(WARMUP_STEPS):
        loop.step()
    state_bytes = sum(t.numel() * t.element_size() for t in loop.state().values())  # AdamW's moments exist now
    chosen = steps or auto_steps(state_bytes, statistics.median(loop.step() for _ in range(BASELINE_STEPS)))
    work = tempfile.mkdtemp(prefix="ckptstream-stall-", dir=directory)
    runs, plain = [], []
    try:
        with session(system, dev) as begin:
            for i in range(checkpoints):
                without_s, times = _plain(loop, chosen)
                plain += times
                path = os.path.join(work, f"ckpt-{i}")
                runs.append(_checkpoint(begin, loop, path, chosen, without_s, statistics.median(times)))
                if os.path.isdir(path):  # DCP writes a folder
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with ckptstream.settings() as cfg:  # those in force
        pass
    out: dict[str, Any] = {"system": system, "device": str(dev), "step_s": statistics.median(plain),
                           "steps": chosen, "checkpoints": checkpoints, "state_bytes": state_bytes,
                           "model": {"d_model": loop.d, "layers": loop.layers, "tokens": loop.tokens},
                           "staging_bytes": cfg.buffer_size * cfg.num_buffers}
    out.update(medians(runs))
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the checkpoints (whether every write ended inside the loop); the
    slowed steps are what the median lost time leaves after the other parts' medians, so that
    the parts still add up."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = (all(values) if key == "ended_inside" else statistics.median(values)) if values else None
    out["slowed_s"] = out["lost_s"] - out["blocked_s"] - out["waited_s"]
    return out


def run(size_gib: float, *, device: str = "auto", systems: tuple[str, ...] | list[str] | None = None,
        directory: str | None = None, checkpoints: int = 2, steps: int | None = None, isolate: bool = True,
        progress: Callable[[str], None] | None = None, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure every system (each in a process of its own with ``isolate``) over the same N steps
    (``steps``, or ``auto_steps`` from the first system that runs); a JSON-able dict with a row per
    system ("error" where one could not run), ratios, and notes on writes that outlasted the loop.
    ``into`` (returned) is kept complete after each system, so that an interrupted run has the rows
    measured before."""
    result = {} if into is None else into
    rows: dict[str, dict[str, Any]] = {}
    result.update({"kind": "training-stall", "size_gib": size_gib, "torch": torch.__version__,
                   "ckptstream": ckptstream.__version__, "systems": rows})
    _summarize(result, steps)
    for system in systems or SYSTEMS:
        if progress is not None:
            progress(f"stall benchmark: {system} ({size_gib:g} GiB state" + (f", {steps} steps)" if steps else ")"))
        try:
            if isolate:
                rows[system] = _in_child(system, size_gib, device, directory, checkpoints, steps)
            else:
                rows[system] = measure(system, size_gib, device=device, directory=directory, checkpoints=checkpoints,
                                       steps=steps)
            steps = rows[system]["steps"]  # the same N for the systems after it
        except Exception as e:  # a peer missing from this torch, or failing: reported, not fatal
            rows[system] = {"system": system, "error": f"{type(e).__name__}: {e}"}
        _summarize(result, steps)
    return result


def _summarize(result: dict[str, Any], steps: int | None) -> None:
    """The run's figures from its rows so far: the loop, N, ratios between rows, notes."""
    rows = result["systems"]
    _ratios(rows)
    first: dict[str, Any] = next((r for r in rows.values() if "error" not in r), {})
    result.update({"device": first.get("device"), "state_bytes": first.get("state_bytes"),
                   "model": first.get("model"), "step_s": first.get("step_s"), "steps": steps,
                   "notes": _outlasted(rows, steps)})


def _ratios(rows: dict[str, dict[str, Any]]) -> None:
    sync = rows.get("sync", {}).get("durable_s")
    dcp = rows.get("dcp.async_save", {}).get("stall_s")
    refs = {name: rows.get(name, {}).get("lost_s") for name in RATIOS_TO}
    for row in rows.values():
        if "error" not in row:
            row["durable_vs_sync"] = row["durable_s"] / sync if sync and row.get("durable_s") else None
            row["stall_vs_dcp"] = dcp / row["stall_s"] if dcp and row.get("stall_s") else None
            row["lost_vs"] = {name: ref / row["lost_s"] if ref and ref > 0 and row["lost_s"] > 0 else None
                              for name, ref in refs.items() if ref is not None}


def _outlasted(rows: dict[str, dict[str, Any]], steps: int | None) -> list[str]:
    """A note for each write that did not end inside the N steps: its lost time holds the wait."""
    notes = []
    for name, row in rows.items():
        if row.get("ended_inside") is False:
            need = math.ceil(row["durable_s"] / row["step_s"]) + 1
            notes.append(f"{name}: its write outlasted the {steps} steps (durable after {_ms(row['durable_s'])}); "
                         f"its lost time includes {_ms(row['waited_s'])} of waiting at the end: run with "
                         f"--training-steps {need} or more for a loop that outlasts it")
    return notes


def _in_child(system: str, size_gib: float, device: str, directory: str | None, checkpoints: int,
              steps: int | None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "ckptstream.bench.training", "--worker", system, "--size-gib", str(size_gib),
            "--device", device, "--checkpoints", str(checkpoints)]
    argv += (["--dir", directory] if directory else []) + (["--steps", str(steps)] if steps else [])
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {system} process failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def _size(v: int | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB" if abs(v) >= GiB else f"{v / MiB:.0f} MiB"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}x" if v >= 10 else f"{v:.2f}x"


def render(result: dict[str, Any]) -> str:
    """The result of ``run`` as a text table."""
    refs = [name for name in RATIOS_TO if "lost_s" in result["systems"].get(name, {})]
    head = ["system", "lost", "blocked", "slowed steps", "wait at end", "stall", "slowdown in flight", "extra GPU",
            "peak RSS", "durable", "/ sync", *(f"lost: {name} / this" for name in refs)]
    lines = []
    for name, r in result["systems"].items():
        if "error" in r:
            lines.append([name, f"could not run: {r['error'][:100]}"] + [""] * (len(head) - 2))
            continue
        ratio = r.get("durable_vs_sync")
        lines.append([name, _ms(r["lost_s"]), _ms(r["blocked_s"]), _ms(r["slowed_s"]), _ms(r["waited_s"]),
                      _ms(r["stall_s"]), _pct(r["slowdown"]), _size(r["extra_gpu_bytes"]), _size(r["peak_rss_bytes"]),
                      _ms(r["durable_s"]), _x(ratio), *(_x(r["lost_vs"].get(ref)) for ref in refs)])
    widths = [max(len(str(row[i])) for row in [head, *lines]) for i in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *lines]]
    model = result.get("model") or {}
    title = (f"training stall: {_size(result.get('state_bytes'))} state on {result.get('device')}, "
             f"d_model {model.get('d_model')}, {model.get('layers')} layers, {model.get('tokens')} tokens per step, "
             f"plain step {_ms(result.get('step_s'))} (torch {result.get('torch')})")
    what = (f"lost per checkpoint = wall time of the same {result.get('steps')} steps with one checkpoint minus "
            "without, the wait for durability at the end included = blocked + slowed steps + wait at end; "
            "while a save is in flight the loop calls its gate just before optimizer.step() (save_async: "
            "handle.wait_staged(), which in host mode orders the update after the copies on the GPU)")
    return "\n".join([title, what, "", *text, *(f"note: {note}" for note in result.get("notes", []))])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptstream.bench.training", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--systems", nargs="+", choices=ALL_SYSTEMS)
    p.add_argument("--dir", help="file system to write the checkpoints to (a temporary folder there)")
    p.add_argument("--checkpoints", type=int, default=2, help="checkpoints per system (the median is shown)")
    p.add_argument("--steps", type=int, help="steps with and without a checkpoint (default: see auto_steps)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--worker", choices=ALL_SYSTEMS, help=argparse.SUPPRESS)  # one system, JSON on stdout
    args = p.parse_args(argv)
    if args.worker:
        # DCP says so from its writer thread at every save (worded two ways): one process, no group, known
        warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        print(json.dumps(measure(args.worker, args.size_gib, device=args.device, directory=args.dir,
                                 checkpoints=args.checkpoints, steps=args.steps)))
        return 0
    result = run(args.size_gib, device=args.device, systems=args.systems, directory=args.dir,
                 checkpoints=args.checkpoints, steps=args.steps, progress=lambda s: print(s, file=sys.stderr))
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
