"""Bounded host memory of export_hf: a state whose single tensor is several times the bound
(staging buffers and a small slack) exports within it, with and without a cast; measured in a
child process of its own, as test_memory.py measures save and load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptstream
from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
SLACK = 8 * MiB  # as test_memory.py: Python objects, the allocator's bookkeeping


@pytest.mark.parametrize("cast", ["none", "bf16"])
def test_peak_rss_of_an_export_is_the_staging_and_a_small_slack(tmp_path: Path, cast: str) -> None:
    src = tmp_path / "state.safetensors"
    ckptstream.save({"w": torch.randn(24 * MiB // 4, 4), "b": torch.randn(1000)}, src)  # a model's flat state
    env = child_env()
    proc = subprocess.run([sys.executable, str(HERE / "child_export.py"), "memory", str(src), str(tmp_path / "hf"),
                           cast], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    allowed = got["staging"] + SLACK
    assert got["staging"] <= (32 if cast != "none" else 16) * MiB
    assert got["largest"] > 2 * allowed  # the tensor could not have been held whole
    assert got["growth"] <= allowed, (f"peak RSS grew {got['growth'] / MiB:.1f} MiB, allowed "
                                      f"{allowed / MiB:.1f} MiB")
    with ckptstream.open(tmp_path / "hf" / "model.safetensors") as reader:
        w = reader.read("w")
    assert torch.equal(w, ckptstream.load(src)["w"].to(w.dtype))
