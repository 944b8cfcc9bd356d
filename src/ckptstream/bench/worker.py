"""One benchmark process: ``python -m ckptstream.bench.worker JOB.json``.

It builds its own state from the job's seed (so its peak RSS is its own), runs one system or
the ceilings or the sweep, with the ckptstream settings of the command line (--buffer-mib, ...),
and writes its raw timings to the job's result file. With the torchrun variables set (RANK,
WORLD_SIZE, ...) it is one rank of a multi-rank run.
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
from typing import Any

import ckptstream

from . import cache
from .cache import Cold
from .ceilings import run_ceilings
from .formats import short_number
from .job import Job, say, spec_of
from .measure import PeakRss, release_memory, synchronize, timed, touch
from .multirank import Group
from .state import assert_same, build_state, empty_like_state, iter_tensors, state_nbytes
from .sweep import run_sweep
from .systems import SYSTEMS, System, Variant, not_installed

HOT_RUNS = 9  # hot loads per variant (the median is reported): single ones swing by more than verifying costs


def timed_phase(group: Group, fn: Callable[[], Any], evict: list[str] | None, cold: Cold,
                warm: bool = False) -> tuple[dict[str, Any], Any]:
    """Run ``fn`` on all ranks at once (barrier-aligned), after evicting ``evict`` from the cache;
    its seconds, peak RSS growth and the staging ckptstream held. A ``warm`` phase (a hot load)
    reuses the staging the phase before it left, as a training process reuses its pool (peers
    keep their own buffers across loads alike); that staging counts in its RSS."""
    record: dict[str, Any] = {}
    group.barrier()
    if evict is not None:
        cache.evict(cold, evict, lead=group.lead)
        group.barrier()
        record["resident"] = cache.resident_fraction(evict)
    if not warm:
        ckptstream.release_staging()  # the phase allocates, and is charged for, the staging it uses
    held = ckptstream.staging_bytes()
    release_memory()
    group.barrier()
    with PeakRss() as rss:
        record["seconds"], out = timed(fn, group.device)
    record.update(rss=rss.growth + held, rss_method=rss.method, staging=ckptstream.staging_bytes())
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
    say(group, f"{what}: {short_number(nbytes / rec['seconds'] / 1e9)} GB/s ({short_number(rec['seconds'])} s), "
               f"peak RSS +{rec['rss'] / 2**20:.0f} MiB{extra}")


def run_system(job: Job, group: Group) -> dict[str, Any]:
    """Save and load the state with one system, ``job["repeat"]`` times; each variant's loads
    cold after each save, hot several times (see HOT_RUNS). A load-only system writes its file
    once, untimed, and loads it cold ``job["repeat"]`` times."""
    system: System = SYSTEMS[job["system"]]
    try:
        importlib.import_module(system.module)  # before the clock: importing DCP alone takes seconds
    except ImportError as e:
        return {"skipped": not_installed(system.name, e)}
    spec, cold = spec_of(job, group), Cold(job["cold"])
    say(group, f"{system.name}: building the state ({spec.summary()}) on {job['device']}")
    state = build_state(spec, group.device)
    synchronize(group.device)
    nbytes = state_nbytes(state)
    os.makedirs(job["dir"], exist_ok=True)
    path, shared = system.path(job["dir"], group.rank), not system.filename
    wanted = job.get("variants") or [v.label for v in system.variants]  # --variants, or all
    variants = tuple(v for v in system.variants_on(job["device"]) if v.label in wanted)
    variants = variants if job["all_variants"] else variants[:1]
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
    hot_rounds = max(1, -(-(job.get("hot_runs") or HOT_RUNS) // job["repeat"])) if "hot" in temps else 0
    prepared = system.prepare(state, world)
    try:
        for r in range(job["repeat"]):
            if system.timed_save:
                _clear(path, group, shared)
                rec, _ = timed_phase(group, lambda: system.save(prepared, path, world), None, cold)
                runs["save"].append(rec)
                _report(group, f"{system.name} save {r + 1}/{job['repeat']}", rec, nbytes)
            else:
                _write_untimed(group, system, prepared, path)
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
    return {"bytes": nbytes, "tensors": sum(1 for _ in iter_tensors(state)), "runs": runs, "load_errors": errors,
            "settings": _staging_in_force()}


def _write_untimed(group: Group, system: System, prepared: Any, path: str) -> None:
    """The file a load-only system reads, written once (the first time), before any clock starts."""
    if os.path.exists(path):
        return
    group.barrier()
    system.save(prepared, path, group.world)
    synchronize(group.device)
    ckptstream.release_staging()
    group.barrier()
    say(group, f"{system.name}: wrote the file it loads (not timed)")


def _staging_in_force() -> dict[str, int]:
    """The ckptstream settings this process ran with (--buffer-mib and the like, or the defaults)."""
    with ckptstream.settings() as current:
        pass
    return {"buffer_size": current.buffer_size, "num_buffers": current.num_buffers, "io_threads": current.io_threads}


def _load(group: Group, state: Any, v: Variant, path: str, evict: list[str] | None, cold: Cold,
          temp: str) -> dict[str, Any]:
    """One timed load of variant ``v``, checked against the saved state."""
    target = empty_like_state(state, group.device, resident=True) if v.in_place else state
    given = v.prepare(target, group.world)

    def load() -> Any:
        out = v.load(path, given, group.device, group.world)
        out = target if v.in_place else out  # filled in place (``given`` may hold it as DTensors)
        touch(out)  # a lazily mapped load has finished only once its bytes are in memory
        return out

    rec, out = timed_phase(group, load, evict, cold, warm=temp == "hot")
    assert_same(state, out, f"{v.label} ({temp} load of {path})")
    return rec


JOBS: dict[str, Callable[[Job, Group], dict[str, Any]]] = {
    "system": run_system, "ceilings": run_ceilings, "sweep": run_sweep,
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
        with group.joined(), ckptstream.settings(**job.get("staging", {})):
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
