"""``ckptstream bench``: the raw disk and copy ceilings, the peers (torch.save, safetensors,
torch.distributed.checkpoint) and ckptstream, measured side by side on the same state in one run.

Modules: ``state`` builds the GPT-like (or many-small-tensors) state, ``ceilings`` measures the
raw rates, ``systems`` says how each system saves and loads, ``worker`` is the child process
that measures one of them, ``runner`` starts the children and cleans up, ``multirank`` adds
several ranks at once, ``sweep`` the staging-buffer sweep, ``report`` and ``plot`` the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from . import cache, machine, report, runner, text
from .options import BenchError, Options, add_arguments, resolve

__all__ = ["BenchError", "add_arguments", "run"]


def _run_bench(opts: Options) -> int:
    raw = runner.run_all(opts)
    rep = report.build(opts, raw, machine.describe(opts.dir))
    print(text.render(rep), flush=True)
    _outputs(opts, rep, lambda path: _plot("plot_report", rep, path))
    return 1 if rep["failed"] else 0


def _run_sweep(opts: Options) -> int:
    from . import sweep
    from .state import StateSpec

    # one tensor of --size-gib (a GPT-like spec would be many tensors)
    spec = StateSpec(tensors=1, tensor_kib=max(4, opts.spec.size_bytes // 1024), seed=opts.spec.seed)
    opts = dataclasses.replace(opts, spec=spec, ranks=1)
    runner.check_resources(opts, spec.nbytes())
    cold = cache.resolve(opts.cold, gentle=opts.quick)
    with runner.workspace(opts) as work:
        runner.say(f"sweep of {len(sweep.grid(runner.base_job(opts, 'sweep', work, cold)))} staging configurations "
                   f"over one {spec.nbytes() / 2**30:.2f} GiB tensor on {opts.device}")
        (result,) = runner.spawn(runner.base_job(opts, "sweep", work, cold), 1, work)
    if "error" in result:
        raise BenchError(f"the sweep failed: {result['error']}")
    limits = report.ceiling_figures([result["ceilings"]])
    resident = limits.get("resident_before_read")
    label = cache.label(cold, resident)
    print(sweep.render(result, limits, opts.device, label), flush=True)
    full = {"schema": 1, "mode": "sweep", "device": opts.device, "cold": {"method": cold.value, "label": label},
            "ceilings": limits, "sweep": result, "machine": machine.describe(opts.dir)}
    _outputs(opts, full, lambda path: _plot("plot_sweep", full, path))
    return 0


def _plot(name: str, data: dict[str, Any], path: str) -> None:
    from . import plot

    getattr(plot, name)(data, path)


def _outputs(opts: Options, data: dict[str, Any], draw: Any) -> None:
    if opts.json:
        report.write_json(data, opts.json)
        runner.say(f"wrote {opts.json}")
    if opts.plot:
        draw(opts.plot)
        runner.say(f"wrote {opts.plot}")


def run(args: argparse.Namespace) -> int:
    """Run ``ckptstream bench`` with parsed arguments; returns the exit status.

    0: every system ran; 1: a system failed (the others are still reported); 2: the benchmark
    could not run as asked (e.g. too little disk space); 130: interrupted (files removed).
    """
    try:
        opts = resolve(args)
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
