"""DCP with ckptstream's storage (``dcp.save`` through ``ckptstream.dcp.StreamWriter``) against
the same ranks saving their shards with ``ckptstream.save``, the two taking turns in one group
of processes, with a per-phase timeline of every DCP save.

``ckptstream bench --ranks N`` runs the systems one after the other, each in processes of its
own, so their saves lie minutes apart; on a disk whose rate drifts by more than the difference
measured (a shared machine, a cloud disk), the order of the systems moves the ratio. Here
every round saves once with each, the order alternating from round to round, every save
starting at a barrier into a directory emptied before it; a save's time is its slowest rank's.
The state is the benchmark's GPT-like state of --size-gib per rank, on the CPU, gloo; the DCP
saves see it as the benchmark's ``dcp-stream`` system does (``as_sharded``: each rank's tensors
its shard of one global DTensor). From the repository's root:

    PYTHONPATH=src python docs/results/dcp_stream_interleaved.py --ranks 2 --size-gib 2 \
        --rounds 6 --dir /tmp/x --json docs/results/interleaved-cpu-ranks2-dcp-stream.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

PHASES = {  # timeline label -> (object path, attribute)
    "plan exchange": ("torch.distributed.checkpoint.utils:_DistWrapper", "reduce_scatter"),
    "write and finish": ("torch.distributed.checkpoint.utils:_DistWrapper", "all_reduce"),
    "write_data": ("ckptstream.dcp:StreamWriter", "write_data"),
    "finish": ("ckptstream.dcp:StreamWriter", "finish"),
    "engine": ("ckptstream._engine:WriteEngine", "run"),  # also in the plain saves
}


def _timed(events: list[tuple[str, float]], label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((label, time.perf_counter() - start))

    return wrapper


def rank_main(args: argparse.Namespace) -> None:
    import importlib

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstream
    from ckptstream.bench.multirank import Group
    from ckptstream.bench.state import StateSpec, build_state
    from ckptstream.dcp import StreamWriter, as_sharded

    events: list[tuple[str, float]] = []
    for label, (where, name) in PHASES.items():
        module, cls = where.split(":")
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, name, _timed(events, label, getattr(owner, name)))
    group = Group("cpu")
    with group.joined():
        state = build_state(StateSpec(size_bytes=int(args.size_gib * 2**30), seed=args.seed), "cpu")
        sharded = as_sharded(state, init_device_mesh("cpu", (group.world,)))
        planner = {}
        if args.plan_caching:  # DCP's own cache of the plans (torch 2.7+): the exchange sends no plan when unchanged
            from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

            planner = {"planner": DefaultSavePlanner(enable_plan_caching=True)}
        saves = {
            "ckptstream": lambda: ckptstream.save(state, os.path.join(args.dir, f"rank-{group.rank}.safetensors")),
            "dcp-stream": lambda: dcp.save(sharded, storage_writer=StreamWriter(os.path.join(args.dir, "dcp")),
                                           **planner),
        }
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = list(saves) if r % 2 == 0 else list(reversed(saves))
            record: dict[str, Any] = {"order": order}
            for name in order:
                group.barrier()
                if group.lead:
                    shutil.rmtree(args.dir, ignore_errors=True)
                    os.makedirs(args.dir)
                group.barrier()
                events.clear()
                start = time.perf_counter()
                saves[name]()
                seconds = time.perf_counter() - start
                ckptstream.release_staging()
                gathered: list[Any] = [None] * group.world
                dist.all_gather_object(gathered, (seconds, list(events)))
                record[name] = {"seconds": max(s for s, _ in gathered),
                                "ranks": [{"seconds": s, "phases": _sum(ev)} for s, ev in gathered]}
            rounds.append(record)
        if group.lead:
            _report(args, rounds)


def _sum(events: list[tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, seconds in events:
        out[label] = out.get(label, 0.0) + seconds
    return out


def _report(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> None:
    from ckptstream.bench.state import StateSpec

    spec = StateSpec(size_bytes=int(args.size_gib * 2**30), seed=args.seed)
    total = spec.nbytes() * args.ranks
    plain = [r["ckptstream"]["seconds"] for r in rounds]
    stream = [r["dcp-stream"]["seconds"] for r in rounds]

    def phase(label: str, system: str = "dcp-stream") -> float:  # the median over rounds of the slowest rank's
        return statistics.median(max(k["phases"].get(label, 0.0) for k in r[system]["ranks"]) for r in rounds)

    summary = {
        "ckptstream_seconds_median": statistics.median(plain),
        "dcp_stream_seconds_median": statistics.median(stream),
        "ckptstream_gbps": total / statistics.median(plain) / 1e9,
        "dcp_stream_gbps": total / statistics.median(stream) / 1e9,
        "ratio_of_medians": statistics.median(plain) / statistics.median(stream),
        "ratio_per_round_median": statistics.median(p / s for p, s in zip(plain, stream, strict=True)),
        "dcp_stream_phases_median": {label: phase(label) for label in PHASES},
        "ckptstream_engine_median": phase("engine", "ckptstream"),
    }
    report = {"command": " ".join(sys.argv[:-1]), "ranks": args.ranks, "state": spec.summary(),
              "plan_caching": args.plan_caching,
              "bytes_per_rank": spec.nbytes(), "rounds": rounds, "summary": summary}
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"{args.ranks} ranks x {spec.summary()}, {args.rounds} rounds, plan caching {args.plan_caching}")
    print("ckptstream s:", " ".join(f"{s:.3f}" for s in plain))
    print("dcp-stream s:", " ".join(f"{s:.3f}" for s in stream))
    print(f"medians: ckptstream {summary['ckptstream_seconds_median']:.3f} s ({summary['ckptstream_gbps']:.3f} GB/s), "
          f"dcp-stream {summary['dcp_stream_seconds_median']:.3f} s ({summary['dcp_stream_gbps']:.3f} GB/s); "
          f"ratio {summary['ratio_of_medians']:.3f} (per round: {summary['ratio_per_round_median']:.3f})")
    print("dcp-stream phases (median s):", {k: round(v, 3) for k, v in summary["dcp_stream_phases_median"].items()})
    print(f"ckptstream engine (median s): {summary['ckptstream_engine_median']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", required=True, help="a folder made (and removed) for the saves")
    parser.add_argument("--json")
    parser.add_argument("--plan-caching", action="store_true",
                        help="DCP saves with DefaultSavePlanner(enable_plan_caching=True), one planner for all rounds")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    from ckptstream.bench.multirank import rank_envs

    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--rank"]
    procs = [subprocess.Popen(argv, env=env) for env in rank_envs(args.ranks)]
    codes = [p.wait() for p in procs]
    shutil.rmtree(args.dir, ignore_errors=True)
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
