"""The stall benchmark (ckptstream.bench.training), tiny, on the CPU: every system runs, every
figure is there and plausible, the table renders; one system in a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptstream.bench import training

TINY = 1 / 1024  # GiB: about 1 MiB of state


def _has_default_stager() -> bool:
    """DCP's DefaultStager (pinned, asynchronous staging) came with torch 2.9."""
    from torch.distributed.checkpoint import staging

    return hasattr(staging, "DefaultStager")


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")  # DCP, no group
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # torch 2.4's FileSystemWriter
def test_every_system_in_process(tmp_path: Path) -> None:
    result = training.run(TINY, device="cpu", directory=str(tmp_path), checkpoints=1, isolate=False)
    json.dumps(result)  # JSON-able
    assert result["device"] == "cpu"
    assert result["kind"] == "training-stall"
    assert 0.5 * TINY * 2**30 <= result["state_bytes"] <= 2 * TINY * 2**30
    assert list(result["systems"]) == list(training.SYSTEMS)
    for name, row in result["systems"].items():
        if name == "dcp.async_save+pinned" and not _has_default_stager():
            assert row["error"].startswith("ImportError: dcp.async_save+pinned needs torch 2.9 or later"), row
            continue
        assert "error" not in row, (name, row)
        assert row["checkpoints"] == 1
        assert row["step_s"] > 0
        assert 0 <= row["blocked_s"] <= row["durable_s"] + row["step_s"], (name, row)
        assert row["durable_s"] > 0
        assert row["extra_gpu_bytes"] == 0
    assert result["systems"]["sync"]["durable_vs_sync"] == pytest.approx(1.0)
    assert list(tmp_path.iterdir()) == []  # every checkpoint removed
    table = training.render(result)
    assert table.splitlines()[0].startswith("training stall: 1 MiB state on cpu")
    for name in training.SYSTEMS:
        assert any(line.startswith(name + " ") for line in table.splitlines()), table


def test_a_system_in_a_process_of_its_own_and_errors_reported(tmp_path: Path) -> None:
    result = training.run(TINY, device="cpu", systems=["lazy"], directory=str(tmp_path), checkpoints=1)
    assert result["systems"]["lazy"]["system"] == "lazy"
    assert result["systems"]["lazy"]["durable_s"] > 0
    broken = training.run(TINY, device="cpu", systems=["lazy"], directory=str(tmp_path / "missing"),
                          checkpoints=1, isolate=False)
    assert "FileNotFoundError" in broken["systems"]["lazy"]["error"]
    assert "could not run" in training.render(broken)
