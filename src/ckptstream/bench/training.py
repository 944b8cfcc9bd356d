"""What a training loop feels of a checkpoint: the stall benchmark.

A GPT-like loop (bf16 weights, fp32 master weights and AdamW on the GPU; fp32 on the CPU) sized
so that its state (weights, master weights, both moments) is ``size_gib``. For each system, in a
process of its own: the median step time without checkpoints, then a few checkpoints taken at a
step boundary while training goes on, each measured for

    blocked   time the loop spends inside the save call and waiting before the next update
    stall     how much longer the step that takes the checkpoint is than a plain step
    slowdown  median step time while the save is in flight, over the plain step time, minus 1
    GPU       extra GPU memory at the peak of the checkpoint (allocated by torch)
    RSS       peak host RSS over the process's before the checkpoint
    durable   seconds from the call until the checkpoint is on disk (fsynced)

Systems: ckptstream.save (sync), save_async in "device", "lazy" and "host" modes, torch.save in a
background thread after a CPU copy, DCP async_save with its default stager, and DCP async_save
with pinned memory and asynchronous staging.

    python -m ckptstream.bench.training --size-gib 8 --json stall.json
    result = training.run(8.0); print(training.render(result))      # from code
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
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

SYSTEMS = ("sync", "device", "lazy", "host", "torch.save+thread", "dcp.async_save", "dcp.async_save+pinned")
OURS = ("device", "lazy", "host")
BASELINE_STEPS, WARMUP_STEPS = 8, 3
MiB, GiB = 1 << 20, 1 << 30


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
        start = time.perf_counter()
        x = self.wte(self.idx)
        for block in self.blocks:
            x = x + block(x)
        x.float().square().mean().backward()
        if self.master is not None:
            for m, p in zip(self.master, self.model.parameters(), strict=True):
                m.grad, p.grad = p.grad.float(), None  # type: ignore[union-attr]
        self.gate_s = 0.0
        if gate is not None:
            before = time.perf_counter()
            gate()
            self.gate_s = time.perf_counter() - before
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.model.parameters(), strict=True):
                    p.copy_(m)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def state(self) -> dict[str, torch.Tensor]:
        """The training state as a flat dict of the live tensors (the same for every system)."""
        out: dict[str, torch.Tensor] = {f"model.{i}": p for i, p in enumerate(self.model.parameters())}
        for i, p in enumerate(self.params):
            if self.master is not None:
                out[f"master.{i}"] = p
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{i}"] = self.opt.state[p][k]
        return out


class Job:
    """A checkpoint in flight: ``gate`` before the next update, ``done``, and when it was durable
    (``durable_at``: a ``time.perf_counter()`` reading, asked once ``finish`` returned)."""

    def __init__(self, done: Callable[[], bool], durable_at: Callable[[], float | None],
                 gate: Callable[[], None] | None = None, finish: Callable[[], Any] = lambda: None) -> None:
        self.done, self.durable_at, self.gate, self.finish = done, durable_at, gate, finish


def _thread_job(work: Callable[[], None]) -> Job:
    ended: list[float] = [0.0]
    error: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:
            error.append(e)
        ended[0] = time.perf_counter()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def finish() -> None:
        thread.join()
        if error:
            raise error[0]

    return Job(lambda: not thread.is_alive(), lambda: ended[0], finish=finish)


def _torch_save(state: dict[str, torch.Tensor], path: str) -> Job:
    cpu = {k: v.detach().cpu() for k, v in state.items()}  # the copy the peers make first

    def write() -> None:
        with open(path, "wb") as f:
            torch.save(cpu, f)
            f.flush()
            os.fsync(f.fileno())

    return _thread_job(write)


def _dcp(state: dict[str, torch.Tensor], path: str, pinned: bool) -> Job:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    ended, recorded = [0.0], threading.Event()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's stager: no pinned memory without CUDA
        if pinned:
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError as e:
                raise ImportError(f"dcp.async_save+pinned needs torch 2.9 or later (DCP's DefaultStager); this is "
                                  f"torch {torch.__version__}") from e

            cuda = torch.cuda.is_available()
            stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=cuda))
            response: Any = async_save(state, checkpoint_id=path, async_stager=stager)
            upload, staging = response.upload_completion, response.staging_completion
        else:
            upload, staging = async_save(state, checkpoint_id=path), None
    def durable(_: Any) -> None:
        ended[0] = time.perf_counter()
        recorded.set()

    upload.add_done_callback(durable)  # callbacks may run after result() returns: wait for it
    gate = (lambda: staging.result()) if staging is not None else None
    return Job(upload.done, lambda: ended[0] if recorded.wait() else None, gate, upload.result)


def start(system: str, state: dict[str, torch.Tensor], path: str) -> Job:
    """Start checkpoint ``system`` of ``state`` at ``path`` (a file, or a folder for DCP)."""
    if system == "sync":
        ckptstream.save(state, path)
        durable = time.perf_counter()
        return Job(lambda: True, lambda: durable)
    if system in OURS:
        began = time.perf_counter()
        h = ckptstream.save_async(state, path, mode=system)

        def durable_at() -> float | None:
            return None if h.seconds_to_durable is None else began + h.seconds_to_durable

        return Job(h.done, durable_at, h.wait_staged, h.result)
    if system == "torch.save+thread":
        return _torch_save(state, path)
    if system.startswith("dcp.async_save"):
        return _dcp(state, path, pinned=system.endswith("+pinned"))
    raise ValueError(f"unknown system {system!r}; known: {list(SYSTEMS)}")


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


def _checkpoint(system: str, loop: Loop, path: str, base_step: float, max_steps: int) -> dict[str, Any]:
    cuda = loop.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated() if cuda else 0
    with _peak_rss() as rss:
        began = time.perf_counter()
        job = start(system, loop.state(), path)
        called = time.perf_counter() - began
        first = called + loop.step(job.gate)
        blocked = called + loop.gate_s
        during: list[float] = []
        while not job.done() and len(during) < max_steps:
            during.append(loop.step(job.gate))
        job.finish()
    durable_at = job.durable_at()
    durable = None if durable_at is None else durable_at - began
    return {"blocked_s": blocked, "stall_s": max(0.0, first - base_step), "durable_s": durable,
            "slowdown": statistics.median(during) / base_step - 1 if during else None, "steps_in_flight": len(during),
            "extra_gpu_bytes": torch.cuda.max_memory_allocated() - gpu_before if cuda else 0,
            "peak_rss_bytes": rss[1] - rss[0]}


def measure(system: str, size_gib: float, *, device: str = "auto", directory: str | None = None,
            checkpoints: int = 2, max_steps: int = 10_000) -> dict[str, Any]:
    """Measure one system in this process (see the module); a JSON-able dict."""
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    loop = Loop(int(size_gib * GiB), dev)
    if system.startswith("dcp"):  # its import is not part of a checkpoint
        importlib.import_module("torch.distributed.checkpoint.state_dict_saver")
    for _ in range(WARMUP_STEPS):
        loop.step()
    base_step = statistics.median(loop.step() for _ in range(BASELINE_STEPS))
    work = tempfile.mkdtemp(prefix="ckptstream-stall-", dir=directory)
    runs = []
    try:
        for i in range(checkpoints):
            path = os.path.join(work, f"ckpt-{i}")
            runs.append(_checkpoint(system, loop, path, base_step, max_steps))
            if os.path.isdir(path):  # DCP writes a folder
                shutil.rmtree(path)
            else:
                os.unlink(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cfg = ckptstream.current_settings()
    out: dict[str, Any] = {"system": system, "device": str(dev), "step_s": base_step, "checkpoints": checkpoints,
                           "state_bytes": sum(t.numel() * t.element_size() for t in loop.state().values()),
                           "model": {"d_model": loop.d, "layers": loop.layers, "tokens": loop.tokens},
                           "staging_bytes": cfg.buffer_size * cfg.num_buffers}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def run(size_gib: float, *, device: str = "auto", systems: tuple[str, ...] | list[str] | None = None,
        directory: str | None = None, checkpoints: int = 2, isolate: bool = True,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every system (each in a process of its own with ``isolate``); a JSON-able dict
    with a row per system ("error" where one could not run) and ratios to the sync save."""
    chosen = list(systems or SYSTEMS)
    rows: dict[str, dict[str, Any]] = {}
    for system in chosen:
        if progress is not None:
            progress(f"stall benchmark: {system} ({size_gib:g} GiB state)")
        try:
            if isolate:
                rows[system] = _in_child(system, size_gib, device, directory, checkpoints)
            else:
                rows[system] = measure(system, size_gib, device=device, directory=directory, checkpoints=checkpoints)
        except Exception as e:  # a peer missing from this torch, or failing: reported, not fatal
            rows[system] = {"system": system, "error": f"{type(e).__name__}: {e}"}
    sync = rows.get("sync", {}).get("durable_s")
    dcp = rows.get("dcp.async_save", {}).get("stall_s")
    for row in rows.values():
        if "error" not in row:
            row["durable_vs_sync"] = row["durable_s"] / sync if sync and row.get("durable_s") else None
            row["stall_vs_dcp"] = dcp / row["stall_s"] if dcp and row.get("stall_s") else None
    first = next((r for r in rows.values() if "error" not in r), {})
    return {"kind": "training-stall", "size_gib": size_gib, "device": first.get("device"),
            "state_bytes": first.get("state_bytes"), "model": first.get("model"), "step_s": first.get("step_s"),
            "torch": torch.__version__, "ckptstream": ckptstream.__version__, "systems": rows}


def _in_child(system: str, size_gib: float, device: str, directory: str | None, checkpoints: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "ckptstream.bench.training", "--worker", system, "--size-gib", str(size_gib),
            "--device", device, "--checkpoints", str(checkpoints)] + (["--dir", directory] if directory else [])
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {system} process failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def _size(v: int | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB" if abs(v) >= GiB else f"{v / MiB:.0f} MiB"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def render(result: dict[str, Any]) -> str:
    """The result of ``run`` as a text table."""
    head = ["system", "blocked", "stall", "slowdown in flight", "extra GPU", "peak RSS", "durable", "/ sync",
            "stall: DCP / this"]
    lines = []
    for name, r in result["systems"].items():
        if "error" in r:
            lines.append([name, f"could not run: {r['error'][:80]}"] + [""] * (len(head) - 2))
            continue
        ratio = r.get("durable_vs_sync")
        vs_dcp = r.get("stall_vs_dcp")
        lines.append([name, _ms(r["blocked_s"]), _ms(r["stall_s"]), _pct(r["slowdown"]), _size(r["extra_gpu_bytes"]),
                      _size(r["peak_rss_bytes"]), _ms(r["durable_s"]), "-" if ratio is None else f"{ratio:.2f}x",
                      "-" if vs_dcp is None else f"{vs_dcp:.0f}x"])
    widths = [max(len(str(row[i])) for row in [head, *lines]) for i in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *lines]]
    model = result.get("model") or {}
    title = (f"training stall: {_size(result.get('state_bytes'))} state on {result.get('device')}, "
             f"d_model {model.get('d_model')}, {model.get('layers')} layers, {model.get('tokens')} tokens per step, "
             f"plain step {_ms(result.get('step_s'))} (torch {result.get('torch')})")
    return "\n".join([title, "", *text])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptstream.bench.training", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS)
    p.add_argument("--dir", help="file system to write the checkpoints to (a temporary folder there)")
    p.add_argument("--checkpoints", type=int, default=2, help="checkpoints per system (the median is shown)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)  # one system, JSON on stdout
    args = p.parse_args(argv)
    if args.worker:
        # DCP says so from its writer thread at every save (worded two ways): one process, no group, known
        warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        print(json.dumps(measure(args.worker, args.size_gib, device=args.device, directory=args.dir,
                                 checkpoints=args.checkpoints)))
        return 0
    result = run(args.size_gib, device=args.device, systems=args.systems, directory=args.dir,
                 checkpoints=args.checkpoints, progress=lambda s: print(s, file=sys.stderr))
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
