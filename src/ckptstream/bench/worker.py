"""One benchmark process: ``python -m ckptstream.bench.worker JOB.json``.

It builds its own state from the job's seed (so its peak RSS is its own), runs one system or
the ceilings or the sweep, and writes its raw timings to the job's result file. With the
torchrun variables set (RANK, WORLD_SIZE, ...) it is one rank of a multi-rank run.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from .._buffers import POOL
from . import cache, ceilings
from .cache import Cold
from .measure import PeakRss, release_memory, synchronize, timed, touch
from .multirank import Group
from .state import StateSpec, assert_same, build_state, empty_like_state, iter_tensors, state_nbytes
from .systems import SYSTEMS, System, Variant, not_installed
from .text import num

HOT_RUNS = 9  # hot loads per variant (the median is reported): single ones swing by +-10%

Job = dict[str, Any]


def say(group: Group, message: str) -> None:
    if group.lead:
        print(f"  {message}", file=sys.stderr, flush=True)


def spec_of(job: Job, group: Group) -> StateSpec:
    spec = StateSpec(**job["spec"])
    # every rank its own data: equal data on all ranks could be deduplicated somewhere below
    return StateSpec(spec.size_bytes, spec.tensors, spec.tensor_kib, spec.seed + group.rank)


def phase(group: Group, fn: Callable[[], Any], evict: list[str] | None, cold: Cold) -> tuple[dict[str, Any], Any]:
    """Run ``fn`` on all ranks at once (barrier-aligned), after evicting ``evict`` from the cache."""
    record: dict[str, Any] = {}
    group.barrier()
    if evict is not None:
        cache.evict(cold, evict, lead=group.lead)
        group.barrier()
        record["resident"] = cache.resident_fraction(evict)
    release_memory()
    group.barrier()
    with PeakRss() as rss:
        record["seconds"], out = timed(fn, group.device)
    record.update(rss=rss.growth, rss_method=rss.method, staging=POOL.idle_bytes())
    POOL.release_all()  # so that the next phase's RSS includes the staging it allocates itself
    group.barrier()
    return record, out


def _clear(path: str, group: Group, shared: bool) -> None:
    """Remove the previous checkpoint; a shared directory (DCP) only by the lead rank."""
    group.barrier()
    if not shared or group.lead:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    group.barrier()


def _report(group: Group, what: str, rec: dict[str, Any], nbytes: int) -> None:
    extra = f", {rec['resident']:.0%} cached before" if rec.get("resident") is not None else ""
    say(group, f"{what}: {num(nbytes / rec['seconds'] / 1e9)} GB/s ({num(rec['seconds'])} s), "
               f"peak RSS +{rec['rss'] / 2**20:.0f} MiB{extra}")


def run_system(job: Job, group: Group) -> dict[str, Any]:
    system: System = SYSTEMS[job["system"]]
    try:
        importlib.import_module(system.module)  # before the clock: importing DCP alone takes seconds
    except ImportError as e:
        return {"skipped": not_installed(system.name, e)}
    spec, cold = spec_of(job, group), Cold(job["cold"])
    say(group, f"{system.name}: building the state ({spec.describe()}) on {job['device']}")
    state = build_state(spec, group.device)
    synchronize(group.device)
    nbytes = state_nbytes(state)
    os.makedirs(job["dir"], exist_ok=True)
    path, shared = system.path(job["dir"], group.rank), not system.filename
    variants = system.variants if job["all_variants"] else system.variants[:1]
    temps = ("cold", "hot") if job["hot"] else ("cold",)
    runs: dict[str, Any] = {"save": [], "loads": {v.label: {t: [] for t in temps} for v in variants}}
    errors: dict[str, str] = {}
    world = group.world

    def load(v: Variant, temp: str, files: list[str], run: str) -> None:
        try:
            rec = _load(group, state, v, path, files if temp == "cold" else None, cold, temp)
        except Exception as e:
            if world > 1:
                raise  # the other ranks are at a barrier already: fail the whole group
            # one process: the system's other loads can still be measured
            errors[v.label] = f"{type(e).__name__}: {e}"
            del runs["loads"][v.label]
            say(group, f"{v.label} {temp} load failed: {errors[v.label]}")
            return
        runs["loads"][v.label][temp].append(rec)
        _report(group, f"{v.label} {temp} load {run}", rec, nbytes)

    # Hot loads take a fraction of a second but vary from run to run: HOT_RUNS of them per
    # variant, the variants taking turns, so that the machine's drift falls on all alike.
    hot_rounds = max(1, -(-HOT_RUNS // job["repeat"])) if "hot" in temps else 0
    try:
        for r in range(job["repeat"]):
            _clear(path, group, shared)
            rec, _ = phase(group, lambda: system.save(state, path, world), None, cold)
            runs["save"].append(rec)
            _report(group, f"{system.name} save {r + 1}/{job['repeat']}", rec, nbytes)
            files = cache.files_under(path)
            for v in variants:
                if v.label not in errors:
                    load(v, "cold", files, f"{r + 1}/{job['repeat']}")
            for h in range(hot_rounds):
                for v in variants:
                    if v.label not in errors:
                        load(v, "hot", files, f"{r * hot_rounds + h + 1}/{job['repeat'] * hot_rounds}")
    finally:
        _clear(path, group, shared)
    return {"bytes": nbytes, "tensors": sum(1 for _ in iter_tensors(state)), "runs": runs, "load_errors": errors}


def _load(group: Group, state: Any, v: Variant, path: str, evict: list[str] | None, cold: Cold, temp: str) -> dict[str, Any]:
    """One timed load of variant ``v``, checked against the saved state."""
    target = empty_like_state(state, group.device, resident=True) if v.in_place else state

    def load() -> Any:
        out = v.load(path, target, group.device, group.world)
        touch(out)  # a lazy loader has loaded once every page was read
        return out

    rec, out = phase(group, load, evict, cold)
    assert_same(state, out, f"{v.label} ({temp} load of {path})")
    return rec


def run_ceilings(job: Job, group: Group) -> dict[str, Any]:
    nbytes, cold = spec_of(job, group).nbytes(), Cold(job["cold"])
    block = ceilings.block_for(nbytes)
    os.makedirs(job["dir"], exist_ok=True)
    path = os.path.join(job["dir"], f"raw.rank{group.rank}")
    threads, hot_threads = job["threads"], job["hot_threads"]
    out: dict[str, Any] = {"bytes": nbytes, "block": block, "resident": []}
    for kind in ("write", "read", "hot"):
        out[kind] = {str(t): [] for t in (hot_threads if kind == "hot" else threads)}

    def measure(kind: str, t: int, fn: Callable[[], float]) -> None:
        group.barrier()
        seconds = fn()
        group.barrier()
        out[kind][str(t)].append(seconds)
        say(group, f"ceiling {kind}, {t} thread(s): {num(nbytes / seconds / 1e9)} GB/s ({num(seconds)} s)")

    try:
        for _ in range(job["repeat"]):
            for t in threads:
                def write(t: int = t) -> float:
                    seconds, out["direct"] = ceilings.raw_write(path, nbytes, t, block)
                    return seconds
                measure("write", t, write)
            for t in threads:
                cache.evict(cold, [path], lead=group.lead)
                group.barrier()
                out["resident"].append(cache.resident_fraction([path]))
                measure("read", t, partial(ceilings.raw_read, path, nbytes, t, block, direct=True))
            if hot_threads:
                ceilings.raw_read(path, nbytes, max(hot_threads), block, direct=False)  # fill the cache
                for t in hot_threads:
                    measure("hot", t, partial(ceilings.raw_read, path, nbytes, t, block, direct=False))
        if group.cuda:
            out["copy"] = ceilings.copy_rates(group.device, nbytes)
            import torch

            out["gpu"] = torch.cuda.get_device_name(group.device)
            out["gpus"] = torch.cuda.device_count()
            if out["copy"]:
                say(group, "ceiling copies (pinned): D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s".format(**out["copy"]))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return out


def _run_sweep(job: Job, group: Group) -> dict[str, Any]:
    from . import sweep

    return sweep.run_job(job, group)


JOBS: dict[str, Callable[[Job, Group], dict[str, Any]]] = {
    "system": run_system, "ceilings": run_ceilings, "sweep": _run_sweep,
}


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwind through the finally blocks that remove files


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job: Job = json.load(f)
    signal.signal(signal.SIGTERM, _terminate)
    group = Group(job["device"])
    result: dict[str, Any] = {"rank": group.rank, "world": group.world}
    rc = 1
    try:
        with group.joined():
            result.update(JOBS[job["kind"]](job, group))
        rc = 0
    except KeyboardInterrupt:
        result["error"] = "interrupted"
        rc = 130
    except Exception as e:
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        tmp = f"{job['result']}.rank{group.rank}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, f"{job['result']}.rank{group.rank}.json")
    return rc


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the result is on disk: skip the interpreter's teardown, which takes seconds with torch loaded
    os._exit(status)
