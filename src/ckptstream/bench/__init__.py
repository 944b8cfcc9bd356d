"""``ckptstream bench``: the raw disk and copy ceilings, the peers (torch.save, safetensors,
torch.distributed.checkpoint, and the fast loaders of the ``bench-peers`` extra) and ckptstream,
measured side by side on the same state in one run.

Modules: ``options`` the command line, ``state`` builds the GPT-like (or many-small-tensors)
state, ``systems`` says how each system saves and loads (``peers`` for the fast loaders),
``training`` and ``checkpointers`` the stall benchmark, ``runner`` starts a worker process per
job and cleans up, ``worker`` is that process (``job`` what it is handed), measuring a system,
the raw rates (``ceilings``) or the staging sweep (``sweep``); ``measure`` and ``cache`` time a
phase and make loads cold, ``multirank`` runs several ranks at once; ``report``, ``text`` and
``plot`` give the output. The benchmark uses ckptstream's public API only.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from . import cache, plot, report, runner, sweep, text
from .machine import machine_description
from .options import BenchError, Options, add_arguments, resolve_options
from .state import StateSpec

__all__ = ["BenchError", "add_arguments", "run"]


INTERRUPTED = "interrupted: the run stopped after the systems above"


def _run_bench(opts: Options) -> int:
    raw: dict[str, Any] = {}
    try:
        runner.run_all(opts, raw)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: report what was measured, then stop
        if raw.get("systems"):
            raw["notes"].append(INTERRUPTED)
            done = {*raw["systems"], *raw["skipped"], *raw["failed"]}
            raw["skipped"].update({name: f"{name} skipped: the run was interrupted before it finished"
                                   for name in opts.systems if name not in done})
            _report_bench(opts, raw)
        raise
    return _report_bench(opts, raw)


def _report_bench(opts: Options, raw: dict[str, Any]) -> int:
    rep = report.build_report(opts, raw, machine_description(opts.dir))
    print(text.render_report(rep), flush=True)
    _outputs(opts, rep, plot.plot_report)
    return 1 if rep["failed"] else 0


def _run_sweep(opts: Options) -> int:
    # one tensor of --size-gib (a GPT-like spec would be many tensors)
    spec = StateSpec(tensors=1, tensor_kib=max(4, opts.spec.size_bytes // 1024), seed=opts.spec.seed)
    opts = dataclasses.replace(opts, spec=spec, ranks=1)
    runner.check_resources(opts, spec.nbytes())
    cold = cache.cold_method(opts.cold, gentle=opts.quick)
    with runner.workspace(opts) as work:
        runner.progress(f"sweep of {len(sweep.staging_configurations(opts.sweep_axes))} staging configurations "
                        f"over one {spec.nbytes() / 2**30:.2f} GiB tensor on {opts.device}")
        (result,) = runner.spawn(runner.base_job(opts, "sweep", work, cold), 1, work)
    if "error" in result:
        raise BenchError(f"the sweep failed: {result['error']}")
    limits = report.ceiling_figures([result["ceilings"]])
    resident = limits.get("resident_before_read")
    label = cache.cold_label(cold, resident)
    print(sweep.render_sweep(result, limits, opts.device, label), flush=True)
    full = {"schema": 1, "mode": "sweep", "device": opts.device, "cold": {"method": cold.value, "label": label},
            "ceilings": limits, "sweep": result, "machine": machine_description(opts.dir)}
    _outputs(opts, full, plot.plot_sweep)
    return 0


def _run_training(opts: Options) -> int:
    from . import training

    unknown = sorted(set(opts.training_systems or ()) - set(training.ALL_SYSTEMS))
    if unknown:
        raise BenchError(f"unknown training system(s) {unknown}; known: {list(training.ALL_SYSTEMS)}")
    result: dict[str, Any] = {}
    try:
        training.run(opts.spec.size_bytes / 2**30, device=opts.device, systems=opts.training_systems,
                     directory=opts.dir, checkpoints=opts.repeat, steps=opts.training_steps,
                     progress=runner.progress, into=result)
    except (KeyboardInterrupt, SystemExit):  # report the systems measured, then stop
        if any("error" not in row for row in result.get("systems", {}).values()):
            result["notes"].append(INTERRUPTED)
            _report_training(opts, result)
        raise
    return _report_training(opts, result)


def _report_training(opts: Options, result: dict[str, Any]) -> int:
    from . import training

    print(training.render(result), flush=True)
    full = {"schema": 1, "mode": "training", "device": opts.device, "training": result,
            "machine": machine_description(opts.dir)}
    _outputs(opts, full, None)
    return 1 if any("error" in r for r in result["systems"].values()) else 0


def _run_export(opts: Options) -> int:
    from . import export

    runner.check_resources(opts, 3 * opts.spec.nbytes())  # the source, a save and an export at once
    result = export.run(opts, runner.progress, {})
    print(export.render(result), flush=True)
    _outputs(opts, {"schema": 1, "mode": "export", "export": result, "machine": machine_description(opts.dir)}, None)
    return 0


def _outputs(opts: Options, data: dict[str, Any], draw: Callable[[dict[str, Any], str], None] | None) -> None:
    """--json and --plot (matplotlib is imported only here, when a plot is asked for)."""
    if opts.json:
        report.write_json(data, opts.json)
        runner.progress(f"wrote {opts.json}")
    if opts.plot and draw is not None:
        draw(data, opts.plot)
        runner.progress(f"wrote {opts.plot}")


def run(args: argparse.Namespace) -> int:
    """Run ``ckptstream bench`` with parsed arguments; returns the exit status.

    0: every system ran; 1: a system failed (the others are still reported); 2: the benchmark
    could not run as asked (e.g. too little disk space); 130: interrupted (files removed).
    """
    try:
        opts = resolve_options(args)
        if opts.dir.lower().startswith("s3://"):
            from . import objectstore

            return objectstore.run(opts)
        if opts.training:
            return _run_training(opts)
        if opts.export:
            return _run_export(opts)
        return _run_sweep(opts) if opts.sweep else _run_bench(opts)
    except BenchError as e:
        print(f"ckptstream bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ckptstream bench: interrupted; temporary files removed", file=sys.stderr)
        return 130
    except OSError as e:  # e.g. --cold drop_caches without root, an unwritable --dir
        print(f"ckptstream bench: error: {e}", file=sys.stderr)
        return 2
