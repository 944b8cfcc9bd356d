"""Kill-and-resume through Accelerate: a tiny GPT-like model (tests/resume/child_accelerate.py)
trained in a subprocess that calls ``accelerator.save_state()`` every 3 steps through
ckptstream, killed with SIGKILL at random steps (after a background save began, while it may
still write), resumed by ``accelerator.load_state()``; its losses and final weights are
bit-equal to an uninterrupted run's, and to Accelerate's own saver's run side by side. The kill
points come from a seeded generator, and are reached by reading the child's output: no timing.
A run killed where its first save holds just before publishing (too narrow a moment to hit by
timing) is followed by one that starts over."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream.accelerate import state_file

CHILD = Path(__file__).parent / "resume" / "child_accelerate.py"
STEPS, SAVE_EVERY = 36, 3  # the child's


def start(directory: Path, saver: str, mode: str, *hold: str) -> subprocess.Popen[str]:
    """The child, its stderr appended to ``<directory>.stderr`` (``errors`` reads it back);
    ``hold`` "first_publish" stops its first save before it publishes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.stderr", "a") as stderr:
        return subprocess.Popen([sys.executable, str(CHILD), str(directory), saver, mode, *hold],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def errors(directory: Path) -> str:
    """The end of what the children of ``directory`` wrote to stderr (for a failed assertion)."""
    return Path(f"{directory}.stderr").read_text()[-3000:]


def losses(lines: list[str]) -> dict[int, str]:
    return {int(line.split()[1]): line.split()[2] for line in lines if line.startswith("step ")}


def run_whole(directory: Path, saver: str, mode: str) -> list[str]:
    child = start(directory, saver, mode)
    out, _ = child.communicate(timeout=600)
    assert child.returncode == 0, out[-2000:] + errors(directory)
    lines = out.splitlines()
    assert lines[0] == "fresh"
    assert lines[-1] == "done"
    return lines


def run_killed(directory: Path, mode: str, chooser: random.Random) -> tuple[int, int, dict[int, str]]:
    """Start the child, pick a step past the one it resumed from, SIGKILL it once it prints that
    step (it may have run a little further by then): (resumed from, killed at, its losses)."""
    child = start(directory, "stream", mode)
    assert child.stdout is not None
    first = child.stdout.readline()  # "fresh" or "resumed N"
    resumed = int(first.split()[1]) if first.startswith("resumed") else 0
    step = chooser.randint(resumed + 1, min(STEPS - 1, resumed + 2 * SAVE_EVERY))
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.startswith(f"step {step} "):
            child.send_signal(signal.SIGKILL)
            break
    child.communicate(timeout=600)
    assert child.returncode == -signal.SIGKILL, (first, lines[-3:], errors(directory))
    return resumed, step, losses(lines)


def lowest_resume(killed_at: int, mode: str) -> int:
    """The earliest step a run killed once it printed ``killed_at`` may resume from: the last save
    before that step, or in the background the one before it (one save runs at a time)."""
    last = ((killed_at - 1) // SAVE_EVERY) * SAVE_EVERY
    return max(0, last - SAVE_EVERY if mode != "sync" else last)


def final_weights(directory: Path) -> dict[str, torch.Tensor]:
    return ckptstream.load(directory / "final.safetensors")


@pytest.mark.timeout(600)
def test_a_run_killed_in_its_first_save_starts_over(tmp_path: Path) -> None:
    """Killed before its first save published (its folder made, its file not yet there): the
    next run finds a checkpoint folder, as Accelerate's recipe looks for one, and load_state()
    loads nothing, so that it trains from the start, step for step as the killed run did."""
    directory = tmp_path / "killed"
    child = start(directory, "stream", "device", "first_publish")
    assert child.stdout is not None
    lines = []
    for line in child.stdout:
        if line == "held\n":
            child.send_signal(signal.SIGKILL)
            break
        lines.append(line)
    child.communicate(timeout=600)
    assert child.returncode == -signal.SIGKILL, (lines[-3:], errors(directory))
    assert lines[0] == "fresh\n"
    killed = losses(lines)
    assert sorted(killed)[:SAVE_EVERY] == [1, 2, 3]
    left = directory / "checkpoints" / "checkpoint_0"
    assert [f.name for f in (directory / "checkpoints").iterdir()] == [left.name]
    [temp] = os.listdir(left)  # the kill's leftover: the state file's temp, not the file
    assert temp.startswith(f".{state_file(left, 0).name}.ckptstream-tmp-")
    child = start(directory, "stream", "device")
    out, _ = child.communicate(timeout=600)
    assert child.returncode == 0, errors(directory)
    resumed = out.splitlines()
    assert resumed[0] == "resumed 0"
    assert "no checkpoint to load" in errors(directory)
    seen = losses(resumed)
    assert sorted(seen) == list(range(1, STEPS + 1))
    assert {s: seen[s] for s in killed} == killed  # bit for bit the steps the killed run ran
    checkpoints = sorted((directory / "checkpoints").iterdir(), key=lambda f: int(f.name.split("_")[1]))
    assert [f.name for f in checkpoints] == ["checkpoint_11", "checkpoint_12"]  # the leftover removed
    assert ckptstream.load(state_file(checkpoints[-1], 0))["custom"][0] == {"step": STEPS}


@pytest.mark.timeout(1800)  # eight training processes in a row: minutes on a loaded machine
def test_killed_runs_resume_bit_for_bit(tmp_path: Path) -> None:
    mode, seed = "device", 1  # background saves: a kill may land while one writes
    whole = losses(run_whole(tmp_path / "whole", "stream", mode))
    default = losses(run_whole(tmp_path / "default", "default", "-"))
    assert default == whole  # Accelerate's own saver, side by side: the same losses
    assert len(whole) == STEPS
    chooser, directory, killed_at = random.Random(seed), tmp_path / "killed", 0
    for _ in range(5):
        resumed, step, seen = run_killed(directory, mode, chooser)
        assert resumed % SAVE_EVERY == 0, resumed
        assert resumed >= lowest_resume(killed_at, mode), (killed_at, resumed)
        assert seen == {s: whole[s] for s in seen}, (step, resumed)  # every step it ran, also those run again
        killed_at = step
    child = start(directory, "stream", mode)
    out, _ = child.communicate(timeout=600)
    lines = out.splitlines()
    assert child.returncode == 0, errors(directory)
    assert lines[-1] == "done"
    resumed = int(lines[0].split()[1]) if lines[0].startswith("resumed") else 0
    assert resumed % SAVE_EVERY == 0
    assert resumed >= lowest_resume(killed_at, mode)
    seen = losses(lines)
    assert seen == {s: whole[s] for s in range(min(seen), STEPS + 1)}
    mine, theirs, reference = final_weights(directory), final_weights(tmp_path / "whole"), final_weights(
        tmp_path / "default")
    assert list(mine) == list(theirs) == list(reference)
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
        assert torch.equal(mine[key], reference[key]), key
    # total_limit=2 (the numbers skip a folder where a run resumed from an older one than the newest)
    checkpoints = sorted((directory / "checkpoints").iterdir(), key=lambda f: int(f.name.split("_")[1]))
    assert len(checkpoints) == 2
    assert ckptstream.load(state_file(checkpoints[-1], 0))["custom"][0] == {"step": STEPS}
    for folder in checkpoints:
        ckptstream.verify(state_file(folder, 0))
    cli = subprocess.run([sys.executable, "-m", "ckptstream", "verify", str(state_file(checkpoints[-1], 0))],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert cli.returncode == 0, cli.stderr
