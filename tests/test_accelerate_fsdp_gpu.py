"""StreamState with Accelerate's FSDP2 on one GPU (``pytest -m gpu``): the model and optimizer
folders that Accelerate saves with DCP hold ckptstream files, and load back bit for bit
(tests/resume/child_accelerate_fsdp.py, started with ``torch.distributed.run``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ckptstream

CHILD = Path(__file__).parent / "resume" / "child_accelerate_fsdp.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.gpu
def test_fsdp2_on_a_gpu_saves_and_loads_through_ckptstream_dcp(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), str(CHILD), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "rank0").read_text() == "ok"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(os.listdir(tmp_path / "ckpt" / folder)) == [".metadata", "rank-00000.safetensors"]
        ckptstream.verify(tmp_path / "ckpt" / folder / "rank-00000.safetensors")
