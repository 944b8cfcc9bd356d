"""The ckptstream command: inspect and verify output and exit codes, in real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptstream


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptstream.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    state = {
        "model": {"w": torch.randn(16, 8), "b": torch.randn(8, dtype=torch.float64)},
        "optim": {"state": {0: {"exp_avg": torch.randn(16, 8)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 12,
    }
    ckptstream.save(state, path, metadata={"run": "alpha"})
    return path


def test_inspect_table_lists_tensors_metadata_and_structure(checkpoint):
    out = run_cli("inspect", str(checkpoint))
    assert out.returncode == 0, out.stderr
    assert "3 tensors" in out.stdout
    assert "checksums: crc32c" in out.stdout
    assert "model.w" in out.stdout
    assert "F32" in out.stdout
    assert "[16, 8]" in out.stdout
    assert "512 B" in out.stdout
    assert "run: alpha" in out.stdout
    assert "model: 2 tensors, 576 B" in out.stdout
    assert "optim: 1 tensors, 512 B" in out.stdout


def test_inspect_json(checkpoint):
    out = run_cli("inspect", str(checkpoint), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {t["key"]: (t["dtype"], t["shape"], t["bytes"]) for t in d["tensors"]} == {
        "model.w": ("F32", [16, 8], 512),
        "model.b": ("F64", [8], 64),
        "optim.state.0.exp_avg": ("F32", [16, 8], 512),
    }
    assert d["metadata"] == {"run": "alpha"}
    assert d["checksums"] == "crc32c"
    assert d["data_offset"] % 4096 == 0
    assert d["data_bytes"] == 1088
    assert d["structure"] == {"model": {"tensors": 2, "bytes": 576}, "optim": {"tensors": 1, "bytes": 512}}


def test_verify_sound_file_exits_0(checkpoint):
    out = run_cli("verify", str(checkpoint))
    assert (out.returncode, out.stdout.strip()) == (0, f"{checkpoint}: OK (3 tensors, checksums verified)")


def test_verify_corrupt_file_exits_1_with_the_reason(checkpoint):
    data = bytearray(checkpoint.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor of the file
    checkpoint.write_bytes(bytes(data))
    out = run_cli("verify", str(checkpoint))
    assert out.returncode == 1
    assert "CRC-32C" in out.stderr
    assert str(checkpoint) in out.stderr


def test_verify_truncated_file_exits_1(checkpoint):
    os.truncate(checkpoint, checkpoint.stat().st_size - 100)
    out = run_cli("verify", str(checkpoint))
    assert out.returncode == 1
    assert "truncated" in out.stderr


@pytest.mark.parametrize("args", [("verify",), ("inspect",), ("frobnicate", "x"), ("verify", "/nonexistent/file")])
def test_usage_errors_exit_2(args):
    out = run_cli(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr
