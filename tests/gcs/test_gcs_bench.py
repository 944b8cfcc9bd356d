"""tests/gcs/bench_gcs.py, small: every figure it reports is there and positive, and the request
counts of a save and a load are those docs/object-stores.md gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gcs.gcsserver import require_emulator
from tests.helpers import child_env


def test_the_gcs_benchmark(tmp_path: Path) -> None:
    require_emulator()
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "-m", "tests.gcs.bench_gcs", "--mib", "64", "--runs", "1", "--json",
                          str(out)], env=child_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    figures = json.loads(out.read_text())
    assert set(figures["median_gbps"]) == {"save", "upload", "upload in parts + compose", "load", "download"}
    assert all(v > 0 for v in figures["median_gbps"].values())
    assert set(figures["paired_ratio"]) == {"save / upload", "save / upload in parts + compose", "load / download"}
    parts = 2 + -(-(figures["bytes"] - (16 << 20)) // (16 << 20))  # the 5 MiB head, the rest of its cell, 16 MiB each
    save = figures["requests"]["save"]
    save.pop("GET bucket", None)  # the library's own look at the bucket, in the background, where it came then
    assert save == {"list": 3, "upload": parts, "compose": 1, "batch": 1}
    assert figures["requests"]["load"] == {"download": 1 + 4}  # 64 MiB in chunks of 16 MiB
