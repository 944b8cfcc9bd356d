"""Kill-and-resume through the Hugging Face Trainer: a tiny GPT-2 (tests/resume/child_trainer.py)
trained 24 steps by ``StreamTrainer``, a checkpoint every 3 steps written in the background
("device" mode), the run SIGKILLed at 5 steps drawn from a seeded generator (after a background
save began, while it may still write), resumed with ``trainer.train(resume_from_checkpoint=True)``:
every step's loss and the final weights are bit-equal to an uninterrupted run's, and the losses to
a run of the Trainer's own saver. The kill points are reached by reading the run's output: no timing.
A run killed where its first save holds just before publishing (too narrow a moment to hit by
timing) is followed by one that, resumed the same way, starts over."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream.transformers import state_file

from .trainerutil import Runs, losses

STEPS, SAVE_EVERY = 24, 3  # the child's


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Runs]:
    server = Runs(tmp_path / "server")
    yield server
    server.close()


def run_killed(runs: Runs, directory: Path, mode: str, chooser: random.Random) -> tuple[int, int, dict[int, str]]:
    """Start a run, pick a step past the one it resumed from, SIGKILL it once it prints that step
    (it may have run a little further by then): (resumed from, killed at, its losses)."""
    pid, out = runs.start(directory, "stream", mode)
    with out:
        first = out.readline()  # "fresh" or "resumed N"
        resumed = int(first.split()[1]) if first.startswith("resumed") else 0
        step = chooser.randint(resumed + 1, min(STEPS - 1, resumed + 2 * SAVE_EVERY))
        lines = []
        for line in out:
            lines.append(line)
            if line.startswith(f"step {step} "):
                os.kill(pid, signal.SIGKILL)
                break
        assert runs.finish(pid) == -signal.SIGKILL, (first, lines[-3:], runs.stderr())
    return resumed, step, losses(lines)


def lowest_resume(killed_at: int, mode: str) -> int:
    """The earliest step a run killed once it printed ``killed_at`` may resume from: the last save
    before that step, or in the background the one before it (one save runs at a time)."""
    last = ((killed_at - 1) // SAVE_EVERY) * SAVE_EVERY
    return max(0, last - SAVE_EVERY if mode != "sync" else last)


def test_a_run_killed_in_its_first_save_starts_over(tmp_path: Path, runs: Runs) -> None:
    """Killed before its first save published (its folder made, its state file not yet there):
    the next run finds a checkpoint folder, as the Trainer's get_last_checkpoint looks for one,
    and train(resume_from_checkpoint=True) starts over, step for step as an uninterrupted run."""
    whole = losses(runs.whole(tmp_path / "whole", "stream", "device"))
    directory = tmp_path / "killed"
    pid, out = runs.start(directory, "stream", "device", "first_publish")
    with out:
        lines = []
        for line in out:
            if line == "held\n":
                os.kill(pid, signal.SIGKILL)
                break
            lines.append(line)
        assert runs.finish(pid) == -signal.SIGKILL, (lines[-3:], runs.stderr())
    assert lines[0] == "fresh\n"
    killed = losses(lines)
    assert sorted(killed)[:SAVE_EVERY] == [1, 2, 3]
    assert killed == {s: whole[s] for s in killed}
    left = directory / "checkpoint-3"
    assert [f.name for f in directory.iterdir()] == [left.name]
    temp, *rest = sorted(os.listdir(left))  # the kill's leftover: the state file's temp, not the file
    assert temp.startswith(f".{state_file(left, 0).name}.ckptstream-tmp-")
    assert rest == ["config.json", "trainer_state.json"]
    lines = runs.whole(directory, "stream", "device")
    assert lines[0] == "resumed 0"
    assert f"{directory}: no checkpoint to resume from, the folders there (checkpoint-3) hold no ckptstream state " \
           "file" in runs.stderr()
    assert losses(lines) == whole
    mine, theirs = ckptstream.load(directory / "final.safetensors"), ckptstream.load(tmp_path / "whole" /
                                                                                      "final.safetensors")
    assert list(mine) == list(theirs)
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    folders = sorted(directory.glob("checkpoint-*"), key=lambda f: int(f.name.split("-")[1]))
    assert [f.name for f in folders] == ["checkpoint-21", "checkpoint-24"]  # the leftover rotated away


def test_killed_trainer_runs_resume_bit_for_bit(tmp_path: Path, runs: Runs) -> None:
    mode, seed = "device", 3
    whole = losses(runs.whole(tmp_path / "whole", "stream", mode))
    default = losses(runs.whole(tmp_path / "default", "default", "-"))
    assert len(whole) == STEPS
    assert default == whole  # the Trainer's own saver, side by side: the same losses
    chooser, directory, killed_at = random.Random(seed), tmp_path / "killed", 0
    for _ in range(5):
        resumed, step, seen = run_killed(runs, directory, mode, chooser)
        assert resumed % SAVE_EVERY == 0, resumed
        assert resumed >= lowest_resume(killed_at, mode), (killed_at, resumed)
        assert seen == {s: whole[s] for s in seen}, (step, resumed)  # every step it ran, also those run again
        killed_at = step
    lines = runs.whole(directory, "stream", mode)
    resumed = int(lines[0].split()[1]) if lines[0].startswith("resumed") else 0
    assert resumed % SAVE_EVERY == 0
    assert resumed >= lowest_resume(killed_at, mode)
    seen = losses(lines)
    assert seen == {s: whole[s] for s in range(resumed + 1, STEPS + 1)}
    mine, theirs = ckptstream.load(directory / "final.safetensors"), ckptstream.load(tmp_path / "whole" /
                                                                                      "final.safetensors")
    reference = ckptstream.load(tmp_path / "default" / "final.safetensors")
    assert list(mine) == list(theirs) == list(reference)
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
        assert torch.equal(mine[key], reference[key]), key
    folders = sorted(directory.glob("checkpoint-*"), key=lambda f: int(f.name.split("-")[1]))
    assert [f.name for f in folders] == ["checkpoint-21", "checkpoint-24"]  # save_total_limit=2
    saved = ckptstream.load(state_file(folders[-1], 0))
    for key, tensor in mine.items():
        assert torch.equal(saved["model"][key], tensor), key
    for folder in folders:
        ckptstream.verify(state_file(folder, 0))
    cli = subprocess.run([sys.executable, "-m", "ckptstream", "verify", str(state_file(folders[-1], 0))],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert cli.returncode == 0, cli.stderr
