"""The printed report: one table per run (single process or ranks), the speedups of
ckptstream over each peer, the targets, and the notes."""

from __future__ import annotations

from typing import Any

from .options import describe_bytes
from .report import Fig, primary


def num(value: float) -> str:
    """Three significant digits at most, never rounded to zero (20,000 x 1 KiB runs are slow)."""
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _gbps(fig: Fig | None) -> str:
    return num(fig["gbps"]) if fig else "-"


def _secs(fig: Fig | None) -> str:
    return num(fig["seconds"]) if fig else "-"


def _x(value: float | None) -> str:
    return num(value) if value is not None else "-"


def _mib(value: float | None) -> str:
    return f"+{value / 2**20:.0f} MiB" if value is not None else "-"


def table(headers: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(line) for line in lines]


def _header(report: dict[str, Any]) -> list[str]:
    ceil, cold, ranks = report["ceilings"], report["cold"]["label"], report["state"]["ranks"]
    who = f"{ranks} ranks x " if ranks > 1 else ""
    fs = report["machine"]["file_system"]["fs_type"]
    out = [f"ckptstream bench: {who}{report['state']['description']}, on {report['device']}, "
           f"median of {report['repeat']} run(s)",
           f"{cold} = " + ("page cache dropped before each load" if cold == "cold" else "page cache NOT dropped")
           + f" ({report['cold']['method']}); file system {fs} at {report['machine']['dir']}"]
    parts = [f"{name} {num(ceil[k]['gbps'])} GB/s ({ceil[k]['threads']} thr)" for k, name in
             (("write", "write O_DIRECT+fsync"), ("read", "cold read O_DIRECT"), ("hot", "hot read page cache")) if k in ceil]
    if ceil.get("copy"):
        parts.append("pinned D2H {d2h:.1f} / H2D {h2d:.1f} GB/s".format(**ceil["copy"]))
    agg = "aggregate " if ranks > 1 else ""
    return [*out, f"{agg}ceilings: " + "; ".join(parts) if parts else "ceilings: not measured", ""]


def _rows(report: dict[str, Any]) -> list[str]:
    cold, multi = report["cold"]["label"], report["state"]["ranks"] > 1
    small = report["state"]["kind"] == "small"  # rates of tiny tensors say little: show times too
    headers = ["system", "save GB/s", "/write", f"{cold} load GB/s", "/read"]
    if multi:
        headers += ["slowest save s", "slowest load s", "RSS/proc save", "RSS/proc load", "RSS total"]
    else:
        headers += ["hot load GB/s", "/hot", "peak RSS save", "peak RSS load", "staging"]
        headers += ["save s", f"{cold} load s", "hot load s"] if small else []
    lines = []
    for row in report["rows"]:
        save, cold_fig, hot = row["save"], row["cold"], row["hot"]
        loads = [f for f in (cold_fig, hot) if f]
        line = [row["label"], _gbps(save), _x(row["save_vs_ceiling"]), _gbps(cold_fig), _x(row["cold_vs_ceiling"])]
        load_rss = _mib(max(f["rss_per_process"] for f in loads) if loads else None)
        if multi:
            line += [_secs(save), _secs(cold_fig), _mib(save["rss_per_process"] if save else None), load_rss,
                     _mib(max(([save["rss_total"]] if save else []) + [f["rss_total"] for f in loads]))]
        else:
            staging = max(([save["staging"]] if save else []) + [f["staging"] for f in loads])
            line += [_gbps(hot), _x(row["hot_vs_ceiling"]), _mib(save["rss_per_process"] if save else None), load_rss,
                     describe_bytes(staging) if staging else "-"]
            line += [_secs(save), _secs(cold_fig), _secs(hot)] if small else []
        lines.append(line)
    return table(headers, lines) if lines else ["(no system ran)"]


def render(report: dict[str, Any]) -> str:
    cold, multi = report["cold"]["label"], report["state"]["ranks"] > 1
    out = _header(report) + _rows(report)
    ours = primary(report["rows"])
    if report["speedups"] and ours is not None:
        phases = ("save", "cold") if multi else ("save", "cold", "hot")
        ups = [[f"vs {label}"] + [f"{r[p]:.2f}x" if r[p] else "-" for p in phases] for label, r in report["speedups"].items()]
        names = {"save": "save", "cold": f"{cold} load", "hot": "hot load"}
        out += ["", *table([f"{ours['label']} speedup"] + [names[p] for p in phases], ups)]
    if report["targets"]:
        out += ["", "targets (set for the GPU machine):"]
        for t in report["targets"]:
            mark = "-" if t["ok"] is None else "ok" if t["ok"] else "MISSED"
            value = "-" if t["value"] is None else f"{t['value']:.2f}"
            out.append(f"  {t['target']}: {value} (want {t['kind']} {t['bound']:g}) {mark}")
    out += [f"note: {note}" for note in report["notes"]]
    out += [f"FAILED: {what}: {error}" for what, error in report["failed"].items()]
    return "\n".join(out)
