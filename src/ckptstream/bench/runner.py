"""The parent process: checks, a temporary workspace, one child process (group) per system, and
clean-up of files and children on success, error and Ctrl-C alike."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from . import cache, machine
from .formats import format_bytes
from .multirank import rank_envs
from .options import BenchError, Options
from .systems import unavailable

Results = list[dict[str, Any]]  # one result per rank
MARGIN = 256 << 20


def progress(message: str) -> None:
    """A progress line of the parent process on stderr (the table goes to stdout)."""
    print(f"ckptstream bench: {message}", file=sys.stderr, flush=True)


def check_resources(opts: Options, nbytes: int) -> None:
    """Fail before any work when the disk is too small; warn when host memory looks short."""
    # one checkpoint exists at a time; twice that leaves the file system (and its other users) slack
    need = 2 * nbytes + MARGIN
    free = shutil.disk_usage(opts.dir).free
    if free < need:
        raise BenchError(
            f"not enough free disk space in {opts.dir}: the benchmark writes up to {format_bytes(need)} "
            f"(about 2x the {format_bytes(nbytes)} of state), but only {format_bytes(free)} is free. "
            "Free some space, point --dir at a larger file system, or lower --size-gib."
        )
    # on the CPU a process holds its state, the loaded copy and a peer's full host copy
    factor = 3.0 if opts.device == "cpu" else 1.5
    available = machine.available_memory()
    if available is not None and available < factor * nbytes:
        # only a warning: some virtual machines report memory that grows as it is used
        progress(f"warning: the run may need about {format_bytes(factor * nbytes)} of host memory ({factor:g}x the "
                 f"{format_bytes(nbytes)} of state on {opts.device}) and {format_bytes(available)} is available now; "
                 "lower --size-gib if a process is killed")


def runnable_systems(opts: Options, notes: list[str], skipped: dict[str, str]) -> list[str]:
    """The systems that can run here; each one that cannot gets a note, and its reason in ``skipped``
    (the report lists it as not run)."""
    names = []
    for name in opts.systems:
        reason = unavailable(name, opts.device)
        if reason is None:
            names.append(name)
        else:
            notes.append(reason)
            skipped[name] = reason
    return names


@contextlib.contextmanager
def workspace(opts: Options) -> Iterator[str]:
    """A temporary folder in --dir, removed whatever happens (SIGTERM included)."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    path = tempfile.mkdtemp(prefix="ckptstream-bench-", dir=opts.dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 0.0) -> None:
    """End the children: after ``grace`` seconds to finish by themselves (on Ctrl-C they got the
    SIGINT too and are removing their files), SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5  # a rank stuck in a collective ignores SIGTERM
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn(job: dict[str, Any], ranks: int, work: str) -> Results:
    """Run one worker per rank on ``job``; a rank that fails stops the others (they would wait
    at a barrier forever). Returns each rank's result (with "error" where it failed)."""
    name = job.get("system") or job["kind"]
    job = dict(job, result=os.path.join(work, f"{name}.result"))
    job_path = os.path.join(work, f"{name}.job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    out = sys.stderr if hasattr(sys.stderr, "fileno") else None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for env in rank_envs(ranks):
            procs.append(subprocess.Popen([sys.executable, "-m", "ckptstream.bench.worker", job_path],
                                          env=env, stdin=subprocess.DEVNULL, stdout=out))
        while True:
            codes = [p.poll() for p in procs]  # every one: a failed rank must not go unnoticed
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, grace=10.0)
        raise
    finally:
        _stop(procs)  # also on Ctrl-C: no orphan keeps writing into the workspace
    results = []
    for rank, p in enumerate(procs):
        path = f"{job['result']}.rank{rank}.json"
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"rank": rank, "error": f"the process exited with status {p.returncode} and left no result"}
        results.append(result)
    return results


def errors_of(results: Results) -> str | None:
    errors = [f"rank {r.get('rank')}: {r['error']}" for r in results if "error" in r]
    return "; ".join(errors) if errors else None


def base_job(opts: Options, kind: str, work: str, cold: cache.Cold) -> dict[str, Any]:
    """The job of one kind ("ceilings", "system", "sweep") that the worker processes read."""
    spec = opts.spec
    return {
        "kind": kind, "device": opts.device, "repeat": opts.repeat, "cold": cold.value,
        "spec": {"size_bytes": spec.size_bytes, "tensors": spec.tensors, "tensor_kib": spec.tensor_kib,
                 "seed": spec.seed},
        "dir": os.path.join(work, kind), "threads": list(opts.threads),
        "hot_threads": [] if opts.ranks > 1 else list(opts.hot_threads),
        "hot": opts.ranks == 1, "all_variants": opts.ranks == 1, "sweep_axes": opts.sweep_axes, "staging": opts.staging,
        "hot_runs": opts.hot_runs, "variants": list(opts.variants),
    }


def _merge_ceilings(before: list[dict[str, Any]] | None, after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One set of ceiling samples per rank: the runs after the systems join those before."""
    if before is None:
        return after
    for old, new in zip(before, after, strict=True):
        for kind in ("write", "read", "hot"):
            for label, seconds in new[kind].items():
                old[kind].setdefault(label, []).extend(seconds)
        old["resident"].extend(new["resident"])
    return before


def run_all(opts: Options, raw: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ceilings, then each system, each in its own process(es). Returns the raw results, filled
    into ``raw`` as they come in (an interrupted run keeps what it measured)."""
    nbytes = opts.total_bytes
    check_resources(opts, nbytes)
    cold = cache.cold_method(opts.cold, gentle=opts.quick)
    notes: list[str] = []
    skipped: dict[str, str] = {}
    names = runnable_systems(opts, notes, skipped)
    for note in notes:
        progress(note)
    if machine.mount_of(opts.dir)["fs_type"] in ("tmpfs", "ramfs"):
        fs_type = machine.mount_of(opts.dir)["fs_type"]
        notes.append(f"{opts.dir} is in memory ({fs_type}): the 'disk' figures measure RAM")
    raw = {} if raw is None else raw
    raw.update({"cold_method": cold.value, "notes": notes, "skipped": skipped, "systems": {}, "failed": {}})
    who = f"{opts.ranks} ranks x " if opts.ranks > 1 else ""
    progress(f"{who}{opts.spec.summary()} on {opts.device}, {opts.repeat} run(s) per figure, in {opts.dir}")
    with workspace(opts) as work:
        # a disk's rate drifts within minutes: measure the ceilings before and after the systems,
        # and compare each system with the median of both
        steps = [("ceilings", None)] + [("system", n) for n in names] + ([] if opts.quick else [("ceilings", None)])
        for i, (kind, name) in enumerate(steps, 1):
            progress(f"[{i}/{len(steps)}] {name or 'raw disk and copy ceilings'}")
            job = base_job(opts, kind, work, cold)
            if name is not None:
                job.update(system=name, dir=os.path.join(work, name))
            results = spawn(job, opts.ranks, work)
            error = errors_of(results)
            if error:
                progress(f"{name or kind} failed: {error}")
                raw["failed"][name or kind] = error
            reason = next((r["skipped"] for r in results if "skipped" in r), None)
            if reason:
                progress(reason)
                notes.append(reason)
                skipped[name or kind] = reason
            elif kind == "ceilings":
                raw["ceilings"] = _merge_ceilings(raw.get("ceilings"), results)
            elif not error:
                raw["systems"][name] = results
                for label, message in results[0].get("load_errors", {}).items():
                    raw["failed"][label] = message
    return raw

