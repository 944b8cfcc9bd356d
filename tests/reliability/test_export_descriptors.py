"""An export holds the descriptors of one shard at a time, however many it writes: an export of
many more shards than a low RLIMIT_NOFILE allows descriptors succeeds (in a child process, whose
limit is set after its imports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import ckptstream
from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
LIMIT = 64
SHARDS = 150  # three descriptors a shard, all held to the end, would be 450


def test_an_export_of_many_shards_fits_a_low_descriptor_limit(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(11)
    state = {f"layer.{i:03d}.weight": torch.randn(1000 + i, generator=g) for i in range(SHARDS)}
    src = tmp_path / "state.safetensors"
    ckptstream.save(state, src)
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(HERE / "child_export.py"), "files", str(src), str(out), str(LIMIT)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shards"] == SHARDS
    assert got["open_before"] + 8 < LIMIT  # room for one shard's descriptors and the source's
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["model.safetensors.index.json"] + [f"model-{i:05d}-of-{SHARDS:05d}.safetensors"
                                                                for i in range(1, SHARDS + 1)])
    for i in (0, 77, SHARDS - 1):
        with ckptstream.open(out / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors") as reader:
            assert reader.keys() == [f"layer.{i:03d}.weight"]
            assert torch.equal(reader.read(f"layer.{i:03d}.weight"), state[f"layer.{i:03d}.weight"])
