"""Bounded host memory: a save or load_into of a 256 MiB CPU state (contiguous, non-contiguous,
strided and tied tensors) grows the process by at most its staging buffers and a small slack;
a load by the loaded state besides. Each measured in a child process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
SLACK = 8 * MiB  # Python objects, the allocator's bookkeeping, one-element temporaries


@pytest.mark.parametrize("op", ["save", "load", "load_into"])
def test_peak_rss_is_the_staging_and_a_small_slack(tmp_path: Path, op: str) -> None:
    env = child_env()
    proc = subprocess.run([sys.executable, str(HERE / "child_memory.py"), op, str(tmp_path), "256"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    allowed = got["staging"] + SLACK + (got["state"] if op == "load" else 0)
    assert got["staging"] <= 16 * MiB
    assert got["growth"] <= allowed, (f"{op}: peak RSS grew {got['growth'] / MiB:.1f} MiB, "
                                      f"allowed {allowed / MiB:.1f} MiB")
