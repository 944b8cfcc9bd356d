"""StreamState in a two-process MULTI_CPU run (gloo, ``torch.distributed.run``): each rank writes
its file, the main process's with the shared state and the other's with its generators only, and
each rank's load gives it back its own generators and the shared state."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

import ckptstream
from ckptstream.accelerate import state_file

CHILD = Path(__file__).parent / "resume" / "child_accelerate_ranks.py"
LIMIT_CHILD = Path(__file__).parent / "resume" / "child_accelerate_limit.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_ranks(child: Path, argument: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), str(child), str(argument)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_ranks_save_and_load_their_own_files(tmp_path: Path) -> None:
    two_ranks(CHILD, tmp_path / "ckpt")
    assert [(tmp_path / f"ckpt.rank{r}").read_text() for r in (0, 1)] == ["ok", "ok"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckptstream_state_0.safetensors",
                                                     "ckptstream_state_1.safetensors"]
    main, other = (ckptstream.load(state_file(tmp_path / "ckpt", r)) for r in (0, 1))
    assert sorted(main) == ["custom", "dataloaders", "models", "optimizers", "rng", "scaler", "schedulers"]
    assert list(other) == ["rng"]  # the shared state once, on the main process
    assert not torch.equal(main["rng"]["torch"], other["rng"]["torch"])


def test_total_limit_removes_only_once_every_ranks_newer_files_are_written(tmp_path: Path) -> None:
    """The other rank's saves write only when it waits for them: the main process's removal of
    checkpoint_<n-2> must come after that rank's file of checkpoint_<n-1> is there, else a kill
    then leaves no checkpoint with both files."""
    two_ranks(LIMIT_CHILD, tmp_path / "project")
    seen = (tmp_path / "project.seen").read_text().splitlines()
    assert seen == ["checkpoint_0 | ", "checkpoint_0 checkpoint_1 | checkpoint_0",
                    "checkpoint_1 checkpoint_2 | checkpoint_1", "checkpoint_2 checkpoint_3 | checkpoint_2"]
