"""The multi-rank benchmark warms each rank up before it measures anything: what a training
job has done before its first checkpoint (the group's first collectives, its first DTensor)
must not be timed as part of the first DCP save."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import ckptstream.dcp
from ckptstream.bench.multirank import rank_envs
from tests.dcp.dcp_helpers import HERE, load_1, same_bits, worker_env


def test_first_dcp_save_after_joining_imports_no_dtensor_machinery(tmp_path: Path) -> None:
    envs = rank_envs(2)
    procs = [subprocess.Popen([sys.executable, str(HERE / "warm_up_worker.py"), str(tmp_path / "ckpt")],
                              env=worker_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for env in envs]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["imported"] == [], report
    # the warmed-up group saved a checkpoint that loads: each rank's shard in rank order
    got = load_1({"w": torch.full((32, 8), float("nan"))}, tmp_path / "ckpt")
    want = torch.cat([torch.randn(16, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    assert same_bits(got["w"], want)
    assert len(ckptstream.dcp.checkpoint_files(tmp_path / "ckpt")) == 3
