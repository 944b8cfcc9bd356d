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


@pytest.mark.parametrize(("seed", "rounds"), [(1, 24), pytest.param(2, 80, marks=pytest.mark.slow)],
                         ids=["quick", "soak"])
def test_repeated_interrupts_leave_nothing_running(tmp_path: Path, seed: int, rounds: int) -> None:
    env = child_env()
    proc = subprocess.run([sys.executable, str(HERE / "child_interrupts.py"), str(tmp_path), str(rounds), str(seed)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["failures"] == []
    assert counts["interrupted"] >= rounds // 2, counts  # the interrupts did land inside the transfers


def test_a_ctrl_c_at_any_point_of_a_save_says_whether_it_published(tmp_path: Path) -> None:
    """A real SIGINT at each of many points of a save (40 spread over the streaming, then every
    Python event from the start of the publish on): the KeyboardInterrupt's ``published`` is
    True exactly where the new checkpoint is on disk and False where the old one still is; a
    save that returns has published; nothing is left behind either way."""
    proc = subprocess.run([sys.executable, str(HERE / "child_save_points.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    expected = {"True": "new", "False": "old", "returned": "new"}
    wrong = [r for r in results if expected.get(r["outcome"]) != r["disk"]
             or r["temps"] or r["threads"] or r["in_use"]]
    assert wrong == [], wrong
    outcomes = [r["outcome"] for r in results]
    # both sides are hit: the streaming (not published) and the publish and after (published)
    assert outcomes.count("False") >= 30, (report["publish"], report["events"])
    assert outcomes.count("True") >= 30, (report["publish"], report["events"])
