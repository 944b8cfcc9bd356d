"""The printed report: one table per run (single process or ranks), the speedups of
ckptstream over each peer, the cost of verifying, the targets where they apply, and the notes."""

from __future__ import annotations

from typing import Any

from .formats import MiB, format_bytes, short_number, table
from .report import Fig, ckptstream_row


def _gbps(fig: Fig | None) -> str:
    return short_number(fig["gbps"]) if fig else "-"


def _secs(fig: Fig | None) -> str:
    return short_number(fig["seconds"]) if fig else "-"


def _x(value: float | None) -> str:
    return short_number(value) if value is not None else "-"


def _mib(value: float | None) -> str:
    return f"+{value / MiB:.0f} MiB" if value is not None else "-"


def _header(report: dict[str, Any]) -> list[str]:
    ceil, cold, ranks = report["ceilings"], report["cold"]["label"], report["state"]["ranks"]
    who = f"{ranks} ranks x " if ranks > 1 else ""
    fs = report["machine"]["file_system"]["fs_type"]
    out = [f"ckptstream bench: {who}{report['state']['description']}, on {report['device']}, "
           f"median of {report['repeat']} run(s)",
           f"{cold} = " + ("page cache dropped before each load" if cold == "cold" else "page cache NOT dropped")
           + f" ({report['cold']['method']}); file system {fs} at {report['machine']['dir']}"]
    staging = report.get("ckptstream_settings")
    if staging:
        out.append(f"ckptstream settings: staging of up to {staging['num_buffers']} x "
                   f"{format_bytes(staging['buffer_size'])} (a transfer allocates the buffers its chunks need), "
                   f"{staging['io_threads']} I/O threads")
    kinds = (("write", "write+fsync"), ("read", "cold read"), ("hot", "hot read"))
    parts = [f"{name} {short_number(ceil[k]['gbps'])} GB/s ({ceil[k]['how']})" for k, name in kinds if k in ceil]
    if ceil.get("memory"):
        parts.append(f"host memory copy {short_number(ceil['memory']['gbps'])} GB/s")
    if ceil.get("copy"):
        parts.append("pinned D2H {d2h:.1f} / H2D {h2d:.1f} GB/s".format(**ceil["copy"]))
    if ceil.get("hot_gpu"):
        parts.append(f"hot load into the GPU {short_number(ceil['hot_gpu']['gbps'])} GB/s ({ceil['hot_gpu']['how']})")
    agg = "aggregate " if ranks > 1 else ""
    return [*out, f"{agg}ceilings: " + "; ".join(parts) if parts else "ceilings: not measured", ""]


def _rss(figs: list[Fig | None], key: str) -> str:
    known = [f[key] for f in figs if f]
    return _mib(max(known) if known else None)


def _rows(report: dict[str, Any]) -> list[str]:
    cold, multi = report["cold"]["label"], report["state"]["ranks"] > 1
    small = report["state"]["kind"] == "small"  # rates of tiny tensors say little: show times too
    headers = ["system", "save GB/s", "save/ceiling", f"{cold} load GB/s", f"{cold} load/ceiling"]
    if multi:
        headers += ["slowest save s", "slowest load s", "RSS/proc save", "RSS/proc load",
                    "RSS total save", "RSS total load"]
    else:
        headers += ["hot load GB/s", "hot load/ceiling", "save RSS growth", "load RSS growth", "staging allocated"]
        headers += ["save s", f"{cold} load s", "hot load s"] if small else []
    lines = []
    for row in report["rows"]:
        save, cold_fig, hot = row["save"], row["cold"], row["hot"]
        line = [row["label"], _gbps(save), _x(row["save_vs_ceiling"]), _gbps(cold_fig), _x(row["cold_vs_ceiling"])]
        if multi:
            line += [_secs(save), _secs(cold_fig),
                     _rss([save], "rss_per_process"), _rss([cold_fig, hot], "rss_per_process"),
                     _rss([save], "rss_total"), _rss([cold_fig, hot], "rss_total")]
        else:
            staging = max(f["staging"] for f in (save, cold_fig, hot) if f)
            line += [_gbps(hot), _x(row["hot_vs_ceiling"]), _rss([save], "rss_per_process"),
                     _rss([cold_fig, hot], "rss_per_process"), format_bytes(staging) if staging else "-"]
            line += [_secs(save), _secs(cold_fig), _secs(hot)] if small else []
        lines.append(line)
    # a system that could not run here keeps its row; the reason is printed under the table
    lines += [[name, "not run"] + ["-"] * (len(headers) - 2) for name in report.get("not_run", {})]
    return table(headers, lines) if lines else ["(no system ran)"]


def _not_run(report: dict[str, Any]) -> list[str]:
    return list(report.get("not_run", {}).values())


def _speedups(report: dict[str, Any]) -> list[str]:
    ours = ckptstream_row(report["rows"])
    if not report["speedups"] or ours is None:
        return []
    phases = ("save", "cold") if report["state"]["ranks"] > 1 else ("save", "cold", "hot")
    names = {"save": "save", "cold": f"{report['cold']['label']} load", "hot": "hot load"}
    ups = [[f"vs {label}"] + [f"{r[p]:.2f}x" if r[p] else "-" for p in phases]
           for label, r in report["speedups"].items()]
    return ["", *table([f"{ours['label']} speedup"] + [names[p] for p in phases], ups)]


def _targets(report: dict[str, Any]) -> list[str]:
    if not report["targets"]:
        return []
    out = ["", f"targets (set for {report['targets_set_for']}):"]
    for t in report["targets"]:
        mark = "-" if t["ok"] is None else "ok" if t["ok"] else "MISSED"
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        out.append(f"  {t['target']}: {value} (want {t['kind']} {t['bound']:g}) {mark}")
    return out


def _verify_line(cost: float, noise: float | None) -> str:
    """The cost of verifying, or "within noise" where the hot loads' own spread is as large."""
    compared = "ckptstream against ckptstream checksum=False"
    if noise is None:
        return f"verifying checksums cost {cost:.1%} of ckptstream's hot load speed ({compared}; one run each)"
    if abs(cost) <= noise:
        return (f"verifying checksums cost within noise: {cost:+.1%} of ckptstream's hot load speed, while the hot "
                f"loads' runs spread {noise:.1%} ({compared})")
    return (f"verifying checksums cost {cost:.1%} of ckptstream's hot load speed (the runs spread {noise:.1%}; "
            f"{compared})")


def render_report(report: dict[str, Any]) -> str:
    """The report as printed on stdout."""
    out = _header(report) + _rows(report) + _not_run(report) + _speedups(report)
    if report.get("verify_cost") is not None:
        out += ["", _verify_line(report["verify_cost"], report.get("verify_noise"))]
    dcp = {p: r for p, r in report.get("dcp_backend_speedups", {}).items() if r}
    if dcp:
        out += ["", "DCP with ckptstream's StreamWriter / StreamReader over DCP's own storage: "
                    + ", ".join(f"{p} {r:.2f}x" for p, r in dcp.items())]
    out += _targets(report)
    out += [f"note: {note}" for note in report["notes"] if note not in report.get("not_run", {}).values()]
    out += [f"FAILED: {what}: {error}" for what, error in report["failed"].items()]
    return "\n".join(out)
