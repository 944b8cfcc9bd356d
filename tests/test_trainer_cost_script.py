"""scripts/trainer-checkpoint-cost.py at a tiny size on the CPU: a smoke check that it runs its
baseline and a saver each in a process of its own and reports them (the figures are the GPU
machine's to measure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer-checkpoint-cost.py"


def test_the_trainer_cost_script_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
    done = subprocess.run([sys.executable, str(SCRIPT), "--size-gib", "0.001", "--width", "32", "--vocab", "64",
                           "--context", "16", "--steps", "4", "--save-every", "2", "--savers", "stream-device",
                           "--deadline", "200", "--dir", str(tmp_path / "runs"), "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("4 steps, a checkpoint every 2 (2 checkpoints)")
    assert "none: loop" in lines[1]
    assert "stream-device: loop" in lines[2]
    assert "(2 checkpoints)" in lines[2]
    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["saver"] for r in results] == ["none", "stream-device"]
    assert len(results[1]["pauses"]) == 2
    assert not (tmp_path / "runs" / "stream-device").exists()  # each run's checkpoints removed after it
