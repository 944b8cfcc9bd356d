"""Bar charts of a report (matplotlib is an optional extra: ``pip install 'ckptstream[bench]'``)."""

from __future__ import annotations

from typing import Any

from .options import BenchError

PHASES = (("save", "save", "write", "tab:blue"), ("cold", "cold load", "read", "tab:orange"),
          ("hot", "hot load", "hot", "tab:green"))


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise BenchError(f"--plot needs matplotlib, which is not installed ({e}); "
                         "pip install 'ckptstream[bench]'") from e
    return plt


def plot_report(report: dict[str, Any], path: str) -> None:
    """Grouped bars: save, cold load and hot load GB/s of each system, each ceiling a dashed line."""
    plt = _pyplot()
    rows, ceilings = report["rows"], report["ceilings"]
    cold = report["cold"]["label"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    width = 0.8 / len(PHASES)
    for j, (key, name, ceiling, color) in enumerate(PHASES):
        label = name.replace("cold", cold)
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ys = [row[key]["gbps"] if row[key] else 0.0 for row in rows]
        ax.bar(xs, ys, width, label=label, color=color)
        if ceiling in ceilings:
            ax.axhline(ceilings[ceiling]["gbps"], color=color, linestyle="--", linewidth=1,
                       label=f"{ceiling} ceiling {ceilings[ceiling]['gbps']:.2f} GB/s")
    ax.set_xticks(range(len(rows)), [row["label"] for row in rows], rotation=20, ha="right")
    ax.set_ylabel("GB/s")
    ranks = report["state"]["ranks"]
    who = f"{ranks} ranks x " if ranks > 1 else ""
    ax.set_title(f"{who}{report['state']['description']} on {report['device']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(report: dict[str, Any], path: str) -> None:
    """One group of bars (write, cold read, hot read) per staging configuration, ceilings dashed."""
    plt = _pyplot()
    rows, ceilings = report["sweep"]["rows"], report["ceilings"]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(rows) + 2), 4.5))
    width = 0.27
    for j, (key, ceiling, color) in enumerate((("write", "write", "tab:blue"), ("cold", "read", "tab:orange"),
                                               ("hot", "hot", "tab:green"))):
        label = "cold read" if key == "cold" else "hot read" if key == "hot" else key
        ax.bar([i + (j - 1) * width for i in range(len(rows))], [r[key] for r in rows], width, label=label, color=color)
        if ceiling in ceilings:
            ax.axhline(ceilings[ceiling]["gbps"], color=color, linestyle="--", linewidth=1,
                       label=f"{ceiling} ceiling {ceilings[ceiling]['gbps']:.2f} GB/s")
    labels = [f"{r['buffer_size'] >> 20}Mx{r['num_buffers']} t{r['io_threads']}{' D' if r['read_direct_io'] else ''}"
              for r in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_yscale("log")  # write, cold and hot rates differ by 10-20x on a GPU machine
    ax.set_title(f"staging sweep: one {report['sweep']['bytes'] / 2**30:.2f} GiB tensor on {report['device']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
