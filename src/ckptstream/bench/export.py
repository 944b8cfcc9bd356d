"""``ckptstream bench --export``: ``export_hf`` against its ceiling, a plain ``ckptstream.save``
of the same bytes to the same disk, measured in the same run.

A GPT-like training state (``state``: bf16 weights, fp32 master weights and moments) is saved
once as the source. Then, run after run, alternating so that drift of the disk hits both alike:
``save`` writes the bf16 weights from memory (on --device) and ``export`` writes the same bytes
from the source file (``prefix="model."``, the source in the page cache, as it is after a
training run wrote it: the source is read once before the runs, as its O_DIRECT save left it
out of the cache); ``save`` again beside ``export --dtype bf16`` of the fp32 master
weights (the same bytes written, twice as many read, each cast). Each figure is the median of
the runs with their range; the ratio is the export's time over the save's, per run pair.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptstream

from .formats import GiB, format_bytes, table
from .options import Options
from .state import build_state, state_nbytes

ROWS = (("export", "model.", None), ("export --dtype bf16 (fp32 master)", "master.", "bf16"))


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def run(opts: Options, progress: Callable[[str], None], into: dict[str, Any]) -> dict[str, Any]:
    """Measure; fills ``into`` (the report so far) as it goes and returns it."""
    state = build_state(opts.spec, opts.device)
    nbytes = state_nbytes(state["model"])
    into.update({"device": opts.device, "state": opts.spec.summary(), "bytes": nbytes, "repeat": opts.repeat,
                 "staging": opts.staging, "rows": {}})
    work = os.path.join(opts.dir, f"ckptstream-bench-export-{os.getpid()}")
    os.makedirs(work)
    try:
        _measure(opts, state, work, progress, into)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return into


def _measure(opts: Options, state: Any, work: str, progress: Callable[[str], None], into: dict[str, Any]) -> None:
    weights, nbytes = state["model"], into["bytes"]
    with ckptstream.settings(**opts.staging):
        source = os.path.join(work, "train.safetensors")
        progress(f"the source: {format_bytes(state_nbytes(state))} training state, saved once")
        ckptstream.save(state, source)
        ckptstream.verify(source)  # read once, buffered: in the page cache, as a training run leaves it
        if opts.device == "cuda":
            torch.cuda.synchronize()
        for label, prefix, dtype in ROWS:
            pairs: list[tuple[float, float]] = []
            for i in range(opts.repeat):
                save_s, export_s = _pair(weights, source, work, prefix, dtype)
                pairs.append((save_s, export_s))
                progress(f"{label} run {i + 1}/{opts.repeat}: save {nbytes / save_s / 1e9:.2f} GB/s, export "
                         f"{nbytes / export_s / 1e9:.2f} GB/s")
            into["rows"][label] = _figures(pairs, nbytes)


def _pair(weights: Any, source: str, work: str, prefix: str, dtype: str | None) -> tuple[float, float]:
    """One save of ``weights`` and one export of ``source``: their seconds (outputs removed)."""
    target, out = os.path.join(work, "save.safetensors"), os.path.join(work, "hf")
    save_s = _timed(lambda: ckptstream.save(weights, target))
    os.remove(target)
    export_s = _timed(lambda: ckptstream.export_hf(source, out, prefix=prefix, dtype=dtype))
    shutil.rmtree(out)
    return save_s, export_s


def _figures(pairs: list[tuple[float, float]], nbytes: int) -> dict[str, Any]:
    ratios = [e / s for s, e in pairs]
    saves, exports = [s for s, _ in pairs], [e for _, e in pairs]
    return {
        "save_s": saves, "export_s": exports, "ratio": ratios,
        "save_gbps": nbytes / statistics.median(saves) / 1e9, "export_gbps": nbytes / statistics.median(exports) / 1e9,
        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
    }


def render(result: dict[str, Any]) -> str:
    lines = [f"export_hf vs ckptstream.save of the same {result['bytes'] / GiB:.2f} GiB ({result['state']}; "
             f"save from {result['device']} memory, export from the source file), {result['repeat']} run pairs:"]
    rows = []
    for label, r in result["rows"].items():
        lo, hi = r["ratio_range"]
        rows.append([label, f"{r['save_gbps']:.2f}", f"{r['export_gbps']:.2f}", f"{r['ratio_median']:.3f}",
                     f"{lo:.3f}-{hi:.3f}"])
    lines += table(["", "save GB/s", "export GB/s", "time ratio", "ratio range"], rows)
    lines.append("time ratio: export time / save time of the same run pair (median; 1.10 is the goal's bound)")
    return "\n".join(lines)
