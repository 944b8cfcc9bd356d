"""``ckptstream bench --sweep``: the staging settings behind the defaults.

One large tensor through device_to_file / file_to_device for every buffer size x buffer count
x I/O threads (threads up to the count: more would idle), write + cold read + hot read,
next to the raw ceilings measured in the same process.
"""

from __future__ import annotations

import itertools
import os
import statistics
from functools import partial
from typing import Any

import torch

import ckptstream

from . import cache
from .cache import Cold
from .ceilings import run_ceilings
from .formats import MiB, format_bytes, table
from .job import Job, say, spec_of
from .measure import timed
from .multirank import Group


def staging_configurations(axes: dict[str, Any]) -> list[dict[str, Any]]:
    """Every combination of the sweep's axes (``Options.sweep_axes``) worth measuring."""
    choices: dict[str, list[bool | None]] = {"auto": [None], "on": [True], "both": [None, True]}
    combos = itertools.product(axes["buffer_mib"], axes["num_buffers"], axes["io_threads"], choices[axes["direct_io"]])
    return [{"buffer_size": b * MiB, "num_buffers": n, "io_threads": t, "read_direct_io": d}
            for b, n, t, d in combos if t <= n]


def _measure(cfg: dict[str, Any], src: torch.Tensor, dst: torch.Tensor, path: str, job: Job,
             group: Group) -> dict[str, Any]:
    """GB/s of write, cold read and hot read with the staging settings ``cfg`` (median of runs)."""
    runs: dict[str, list[float]] = {"write": [], "cold": [], "hot": []}
    for _ in range(job["repeat"]):
        with ckptstream.settings(buffer_size=cfg["buffer_size"], num_buffers=cfg["num_buffers"],
                                 io_threads=cfg["io_threads"]):
            runs["write"].append(timed(partial(ckptstream.device_to_file, src, path), group.device)[0])
            ckptstream.release_staging()  # each configuration allocates (and is charged for) its own buffers
            read = partial(ckptstream.file_to_device, path, dst)
            with ckptstream.settings(direct_io=cfg["read_direct_io"]):
                cache.evict(Cold(job["cold"]), [path])
                runs["cold"].append(timed(read, group.device)[0])
                if not torch.equal(src, dst):
                    raise AssertionError(f"sweep {cfg}: the data read back differs from what was written")
                runs["hot"].append(timed(read, group.device)[0])
            ckptstream.release_staging()
    return dict(cfg, **{k: src.nbytes / statistics.median(v) / 1e9 for k, v in runs.items()})


def run_sweep(job: Job, group: Group) -> dict[str, Any]:
    """The worker's side of --sweep: the ceilings, then every staging configuration."""
    spec = spec_of(job, group)
    nbytes = spec.nbytes()  # one tensor (the parent makes the spec so)
    limits = run_ceilings(dict(job, repeat=1), group)  # same bytes, same process, same minute
    gen = torch.Generator(device=group.device)
    gen.manual_seed(spec.seed)
    src = torch.randn(nbytes // 4, generator=gen, device=group.device)
    dst = torch.empty_like(src)
    path = os.path.join(job["dir"], f"sweep.rank{group.rank}.bin")
    configs = staging_configurations(job["sweep_axes"])
    rows = []
    try:
        for i, cfg in enumerate(configs, 1):
            row = _measure(cfg, src, dst, path, job, group)
            rows.append(row)
            say(group, f"sweep {i}/{len(configs)}: {staging_summary(row)}: write {row['write']:.2f}, "
                       f"cold read {row['cold']:.2f}, hot read {row['hot']:.2f} GB/s")
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"bytes": nbytes, "ceilings": limits, "rows": rows}


def staging_summary(cfg: dict[str, Any]) -> str:
    """"8 x 16 MiB, 8 I/O threads" (and whether reads bypass the page cache)."""
    direct = {None: "", True: ", O_DIRECT reads"}[cfg["read_direct_io"]]
    return f"{cfg['num_buffers']} x {cfg['buffer_size'] // MiB} MiB, {cfg['io_threads']} I/O threads{direct}"


def render_sweep(result: dict[str, Any], ceiling: dict[str, Any], device: str, cold: str) -> str:
    """The printed table of a sweep: each configuration's rates and their ratios to the ceilings."""
    w, r, h = (ceiling.get(k, {}).get("gbps") for k in ("write", "read", "hot"))

    def rel(value: float, limit: float | None) -> str:
        return f"{value / limit:.2f}" if limit else "-"

    lines = [[f"{c['buffer_size'] // MiB}", str(c["num_buffers"]), str(c["io_threads"]),
              "direct" if c["read_direct_io"] else "buffered",
              f"{c['write']:.2f}", rel(c["write"], w),
              f"{c['cold']:.2f}", rel(c["cold"], r),
              f"{c['hot']:.2f}", rel(c["hot"], h)]
             for c in result["rows"]]
    head = [f"sweep: one {format_bytes(result['bytes'])} tensor on {device}; loads {cold}; ceilings: write "
            f"{w or 0:.2f}, read {r or 0:.2f}, hot {h or 0:.2f} GB/s"]
    rows = table(["buffer MiB", "buffers", "io threads", "reads", "write GB/s", "/write", f"{cold} GB/s", "/read",
                  "hot GB/s", "/hot"], lines)
    best = [f"best {k}: {staging_summary(max(result['rows'], key=lambda c: c[k]))}" for k in ("write", "cold", "hot")]
    with ckptstream.settings() as defaults:
        pass
    best.append(f"current defaults: {defaults.num_buffers} x {defaults.buffer_size // MiB} MiB, "
                f"{defaults.io_threads} I/O threads")
    return "\n".join(head + rows + [""] + best)
