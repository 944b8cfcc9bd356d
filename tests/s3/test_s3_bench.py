"""``ckptstream bench --dir s3://...`` against the real server: the raw client's uploads and
downloads beside save, load and load_into, a JSON of the figures, nothing left in the bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ckptstream.bench.objectstore import ROWS
from tests.s3.s3util import Bucket, s3, s3_server  # noqa: F401


def test_bench_on_an_object_store(s3: Bucket, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    s3.put("runs/keep", b"the user's")
    run = subprocess.run([sys.executable, "-m", "ckptstream.cli", "bench", "--dir", s3.url("runs"), "--quick",
                          "--device", "cpu", "--json", str(out)], env={**os.environ, "PYTHONPATH": "src"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    figures = json.loads(out.read_text())
    assert set(figures["median_gbps"]) == set(ROWS)
    assert all(v > 0 for v in figures["median_gbps"].values())
    assert all(len(v) == figures["runs"] for v in figures["cpu_s"].values())
    assert set(figures["ratio"]) == set(figures["paired_ratio"]) == {"save", "load", "load_into"}
    assert "save / upload (raw client)" in run.stdout
    assert s3.keys() == ["runs/keep"]  # its own prefix removed, nothing else touched
    assert s3.uploads() == []
