"""From the processes' raw timings to the report: figures (medians over runs, aggregated over
ranks), ratios to the ceilings and to the peers, the targets where they apply, and the JSON."""

from __future__ import annotations

import json
import statistics
from typing import Any

from . import cache
from .options import Options
from .systems import LOAD_PEERS, PEERS

Fig = dict[str, Any]
# The targets are set for the GPU machine the library is built for, with the GPT-like state; on
# another device or state they would judge what they were not set for.
TARGET_DEVICE, TARGET_STATE = "cuda", "gpt"
TARGETS_SET_FOR = {"single": "one H200 GPU machine, 8 GiB GPT-like state",
                   "ranks": "H200 GPU machines, one GPU and a 4-8 GiB GPT-like state per rank"}


def phase_figure(per_rank: list[list[dict[str, Any]]], total_bytes: int) -> Fig:
    """One phase over ranks and runs: in each run the slowest rank sets the time (all started at
    a barrier), and the rate is every rank's bytes over it; then the median over runs."""
    runs = min(len(r) for r in per_rank)
    slowest = [max(r[i]["seconds"] for r in per_rank) for i in range(runs)]
    rss = [[r[i]["rss"] for r in per_rank] for i in range(runs)]
    resident = [r[i].get("resident") for r in per_rank for i in range(runs)]
    known = [x for x in resident if x is not None]
    return {
        "gbps": statistics.median(total_bytes / s / 1e9 for s in slowest),
        "gbps_runs": [total_bytes / s / 1e9 for s in slowest],
        "seconds": statistics.median(slowest), "seconds_runs": slowest,
        "rss_per_process": statistics.median(max(x) for x in rss),
        "rss_total": statistics.median(sum(x) for x in rss),
        "rss_method": per_rank[0][0]["rss_method"],
        "staging": max(r[i]["staging"] for r in per_rank for i in range(runs)),
        "resident_before": max(known) if known else None,
    }


def ceiling_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each ceiling: the best probe of its sweep, its rate aggregated over ranks like the
    systems'; for loads into a GPU from the page cache ("hot_gpu"), the best pipeline through
    pinned buffers where it was measured, else the slower of the hot read and the pinned
    host-to-device copy (a bound: it leaves out that the bytes cross host memory three times)."""
    total = sum(r["bytes"] for r in results)
    out: dict[str, Any] = {"bytes": total, "block": results[0]["block"], "direct": results[0].get("direct")}
    for kind in ("write", "read", "hot", "pipeline"):
        by_probe = {}
        for label in results[0].get(kind, ()):
            runs = min(len(r[kind].get(label, ())) for r in results)
            if runs:
                slowest = [max(r[kind][label][i] for r in results) for i in range(runs)]
                by_probe[label] = statistics.median(total / s / 1e9 for s in slowest)
        if by_probe:
            best = max(by_probe, key=lambda label: by_probe[label])
            out[kind] = {"gbps": by_probe[best], "how": best, "by_probe": by_probe}
    known = [x for r in results for x in r["resident"] if x is not None]
    out["resident_before_read"] = max(known) if known else None
    if results[0].get("memory"):
        out["memory"] = {"gbps": min(r["memory"] for r in results)}
    if "copy" in results[0]:
        out["copy"] = results[0]["copy"]
        out["gpu"], out["gpus"] = results[0]["gpu"], results[0]["gpus"]
        if "pipeline" in out:
            out["hot_gpu"] = out.pop("pipeline")
        elif "hot" in out and out["copy"].get("h2d"):
            h2d = out["copy"]["h2d"] * len(results)
            out["hot_gpu"] = ({"gbps": h2d, "how": "pinned H2D"} if h2d < out["hot"]["gbps"]
                              else {"gbps": out["hot"]["gbps"], "how": out["hot"]["how"]})
    return out


def _ratio(a: Fig | None, b: Any) -> float | None:
    if a is None or not isinstance(b, dict) or not b.get("gbps"):
        return None
    return float(a["gbps"]) / float(b["gbps"])


def system_rows(systems: dict[str, list[dict[str, Any]]], ceilings: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, results in systems.items():
        total = sum(r["bytes"] for r in results)
        # a load-only system (a peer loader) wrote its file untimed: no save figure
        save = phase_figure([r["runs"]["save"] for r in results], total) if results[0]["runs"]["save"] else None
        for i, label in enumerate(results[0]["runs"]["loads"]):
            loads = {t: phase_figure([r["runs"]["loads"][label][t] for r in results], total)
                     for t in results[0]["runs"]["loads"][label]}
            row = {"system": name, "label": label, "bytes": total, "tensors": results[0]["tensors"],
                   "save": save if i == 0 else None, "cold": loads.get("cold"), "hot": loads.get("hot")}
            row["save_vs_ceiling"] = _ratio(row["save"], ceilings.get("write"))
            row["cold_vs_ceiling"] = _ratio(row["cold"], ceilings.get("read"))
            row["hot_vs_ceiling"] = _ratio(row["hot"], ceilings.get("hot_gpu") or ceilings.get("hot"))
            rows.append(row)
    return rows


def ckptstream_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of ``ckptstream.save`` / ``ckptstream.load``, which the peers are compared with."""
    return next((row for row in rows if row["label"] == "ckptstream"), None)


def speedups(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """ckptstream's rate over each peer's, per phase (None where a side has no figure)."""
    ours = ckptstream_row(rows)
    if ours is None:
        return {}
    return {row["label"]: {p: _ratio(ours[p], row[p]) for p in ("save", "cold", "hot")}
            for row in rows if row["system"] in PEERS}


def dcp_backend_speedups(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """DCP with ckptstream's StreamWriter / StreamReader over DCP with its own storage, per phase."""
    by_label = {row["label"]: row for row in rows}
    stream, own = by_label.get("dcp-stream"), by_label.get("dcp")
    if stream is None or own is None:
        return {}
    return {p: _ratio(stream[p], own[p]) for p in ("save", "cold", "hot")}


def _dcp_targets(rows: list[dict[str, Any]]) -> list[tuple[str, float | None, float]]:
    """The targets of ckptstream's DCP storage on several ranks."""
    stream = next((row for row in rows if row["label"] == "dcp-stream"), None)
    if stream is None or stream["save"] is None:
        return []
    ups = dcp_backend_speedups(rows)
    loads = [f for f in (stream["cold"], stream["hot"]) if f]
    return [
        ("DCP+StreamWriter save / write ceiling", stream["save_vs_ceiling"], 0.9),
        ("DCP+StreamWriter save speedup over DCP's own writer", ups.get("save"), 2.5),
        ("DCP+StreamReader cold load / read ceiling", stream["cold_vs_ceiling"], 0.95),
        ("DCP+StreamReader cold load speedup over DCP's own reader", ups.get("cold"), 1.0),
        ("DCP+StreamWriter peak RSS per rank - staging (MiB)",
         (stream["save"]["rss_per_process"] - stream["save"]["staging"]) / 2**20, -64),
        ("DCP+StreamReader peak RSS per rank - staging (MiB)",
         max((f["rss_per_process"] - f["staging"]) / 2**20 for f in loads) if loads else None, -64),
    ]


def _load_peer_targets(rows: list[dict[str, Any]], ups: dict[str, dict[str, float | None]]
                       ) -> list[tuple[str, float | None, float]]:
    """Loads ahead of each fast loader that ran: 1.05x cold, 1.1x hot."""
    ran = [row["label"] for row in rows if row["system"] in LOAD_PEERS]
    return [(f"{temp} load speedup over {label}", ups.get(label, {}).get(temp), need)
            for label in ran for temp, need in (("cold", 1.05), ("hot", 1.1))]


def verify_cost(rows: list[dict[str, Any]]) -> float | None:
    """1 - (hot load with checksums verified) / (hot load without): the cost of verifying."""
    hot = {row["label"]: row["hot"] for row in rows}
    on, off = hot.get("ckptstream"), hot.get("ckptstream checksum=False")
    return 1 - on["gbps"] / off["gbps"] if on and off else None


def verify_noise(rows: list[dict[str, Any]]) -> float | None:
    """The run-to-run noise of the two hot loads ``verify_cost`` compares: the larger of their
    interquartile ranges over their medians (None where either ran once). A cost no larger than
    that cannot be told from the machine's own variation."""
    hot = {row["label"]: row["hot"] for row in rows}
    spreads: list[float] = []
    for label in ("ckptstream", "ckptstream checksum=False"):
        runs: list[float] = (hot.get(label) or {}).get("gbps_runs", [])
        if len(runs) < 2:
            return None
        q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive")
        spreads.append((q3 - q1) / statistics.median(runs))
    return max(spreads)


def targets(rows: list[dict[str, Any]], ranks: int, kind: str, device: str) -> list[dict[str, Any]]:
    """The targets (see TARGETS_SET_FOR), checked against this run's figures; none where they do
    not apply (another device or kind of state)."""
    ours = ckptstream_row(rows)
    if ours is None or ours["save"] is None or device != TARGET_DEVICE or kind != TARGET_STATE:
        return []
    ups = speedups(rows)
    save = ours["save"]
    out: list[tuple[str, float | None, float]] = [
        ("save / write ceiling", ours["save_vs_ceiling"], 0.95),
        ("peak RSS growth of save - staging (MiB)", (save["rss_per_process"] - save["staging"]) / 2**20, -64),
    ]
    out += _dcp_targets(rows) if ranks > 1 else []
    if ranks == 1:
        out += [(f"save speedup over {p}", ups.get(p, {}).get("save"), need)
                for p, need in (("torch", 3.0), ("safetensors", 3.5), ("dcp", 3.5))]
        out += [("cold load / read ceiling", ours["cold_vs_ceiling"], 0.95)]
        out += [(f"cold load speedup over {p}", ups.get(p, {}).get("cold"), 1.0)
                for p in ("torch", "safetensors", "dcp")]
        out += _load_peer_targets(rows, ups)
        out += [("hot load / hot load ceiling", ours["hot_vs_ceiling"], 0.9)]
        out += [("share of hot load speed that verifying costs", verify_cost(rows), -0.10)]
    # a negative bound is an upper bound (RSS must stay below it)
    return [{"target": name, "value": value, "bound": abs(bound), "kind": "<=" if bound < 0 else ">=",
             "ok": None if value is None else (value <= -bound if bound < 0 else value >= bound)}
            for name, value, bound in out]


def _ckptstream_settings(raw: dict[str, Any]) -> dict[str, int] | None:
    results = raw["systems"].get("ckptstream") or raw["systems"].get("engine")
    return results[0].get("settings") if results else None


def build_report(opts: Options, raw: dict[str, Any], machine_info: dict[str, Any]) -> dict[str, Any]:
    """The report of one run: everything the printed table, the plot and the JSON show."""
    ceilings = ceiling_figures(raw["ceilings"]) if raw.get("ceilings") and not raw["failed"].get("ceilings") else {}
    rows = system_rows(raw["systems"], ceilings)
    residents = [row["cold"]["resident_before"] for row in rows if row["cold"]] + [ceilings.get("resident_before_read")]
    worst = max((r for r in residents if r is not None), default=None)
    method = cache.Cold(raw["cold_method"])
    if ceilings.get("gpu"):
        machine_info = dict(machine_info, gpu=ceilings["gpu"], gpus=ceilings["gpus"])
    mode = "ranks" if opts.ranks > 1 else "single"
    found = targets(rows, opts.ranks, opts.spec.kind, opts.device)
    return {
        "schema": 1, "mode": mode, "device": opts.device,
        "state": {"description": opts.spec.summary(), "kind": opts.spec.kind, "bytes_per_rank": opts.spec.nbytes(),
                  "size_bytes": opts.spec.size_bytes, "tensors": opts.spec.tensors, "tensor_kib": opts.spec.tensor_kib,
                  "seed": opts.spec.seed, "ranks": opts.ranks},
        "repeat": opts.repeat, "ckptstream_settings": _ckptstream_settings(raw),
        "cold": {"method": method.value, "label": cache.cold_label(method, worst), "worst_resident_fraction": worst},
        "ceilings": ceilings, "rows": rows, "speedups": speedups(rows), "verify_cost": verify_cost(rows),
        "verify_noise": verify_noise(rows),
        "dcp_backend_speedups": dcp_backend_speedups(rows),
        "targets": found, "targets_set_for": TARGETS_SET_FOR[mode] if found else None,
        "not_run": raw.get("skipped", {}), "notes": raw["notes"], "failed": raw["failed"], "machine": machine_info,
        "raw": raw,
    }


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")
