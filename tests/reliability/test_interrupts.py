"""Two or three Ctrl-Cs in quick succession during saves and loads (real SIGINTs, in a child
process with Python's default handler while ckptstream runs): the interrupt reaches the caller
only once every ckptstream thread is joined, the staging pool is whole, no descriptor or temp
file is left, the checkpoint is complete, and no freed descriptor receives a stray write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("seed", [1, 2])
def test_repeated_interrupts_leave_nothing_running(tmp_path: Path, seed: int) -> None:
    env = child_env()
    proc = subprocess.run([sys.executable, str(HERE / "child_interrupts.py"), str(tmp_path), "40", str(seed)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["failures"] == []
    assert counts["interrupted"] >= 20, counts  # the interrupts did land inside the transfers
