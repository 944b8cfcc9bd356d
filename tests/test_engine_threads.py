"""A process that cannot start one more thread, for real (a child whose address space has no
room for another thread's stack): ``save``, ``load`` (streamed and mapped), ``save_async`` and
the manager raise ThreadStartError, which says so and keeps Python's error as its cause, and
leave no thread, staging buffer, descriptor or file behind; once threads can start again the
same call works."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream._engine.buffers import POOL
from tests.helpers import child_env, engine_threads

SMALL = ckptstream.Settings(buffer_size=64 << 10, num_buffers=4, io_threads=3)

CHILD = Path(__file__).resolve().parent / "reliability" / "child_thread_limit.py"
# CASE:K, K the threads that can still start: the engine's first or second I/O thread fails, a
# mapped load's second checksum thread, a background save's own thread or its engine's first
CASES = ["save:0", "save:1", "load:0", "load:1", "load-mapped:0", "save_async:0", "save_async:1",
         "manager:0", "manager:1"]


def test_a_thread_that_cannot_start_raises_thread_start_error(tmp_path: Path) -> None:
    # one glibc malloc arena: a new thread's arena would take address space the test allots
    proc = subprocess.run([sys.executable, str(CHILD), str(tmp_path), *CASES], capture_output=True, text=True,
                          timeout=240, env=child_env(MALLOC_ARENA_MAX="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(reports) == sorted(CASES)
    for spec, report in reports.items():
        case = spec.split(":")[0]
        assert report["error"] == "ThreadStartError", (spec, report)
        assert report["is_runtime_error"], (spec, report)
        assert report["cause"] == "RuntimeError(\"can't start new thread\")", (spec, report)
        assert report["message"].startswith("ckptstream could not start "), (spec, report)
        assert "can't start new thread. The process has reached a limit on threads" in report["message"], spec
        named = "run/step-000000000001/state.safetensors" if case == "manager" else "ckpt.safetensors"
        assert f"{tmp_path / spec.replace(':', '-') / named}: can't start" in report["message"], (spec, report)
        # nothing left: the threads that did start are joined, the buffers back, the temp gone
        assert report["threads"] == [], (spec, report)
        assert report["in_use"] == 0, (spec, report)
        assert report["fds_left"] == [], (spec, report)
        expected_files = ["ckpt.safetensors", "run/.lock-rank-00000"] if case == "manager" else ["ckpt.safetensors"]
        assert report["files"] == expected_files, (spec, report)
        assert report["old_kept"], (spec, report)
        assert report["steps"] == [], (spec, report)
        assert report["then"], (spec, report)
    assert "I/O thread 2 of 3" in reports["save:1"]["message"]
    assert "I/O thread 1 of 3" in reports["save_async:1"]["message"]
    assert "the background save of" in reports["save_async:0"]["message"]
    assert "checksum thread 2 of 2" in reports["load-mapped:0"]["message"]


@pytest.mark.parametrize("started", [0, 1])
def test_a_failed_thread_start_returns_the_staging_on_every_device(
        device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: int) -> None:
    """The same failure in this process, on each device (on a GPU: pinned staging buffers and
    the side stream): ``Thread.start`` of the engine's I/O thread ``started + 1`` raises as
    Python does when pthread_create fails; the save and the load raise ThreadStartError, and the
    pinned buffers are back in the pool with no I/O thread left."""
    path = tmp_path / "ckpt.safetensors"
    old = {"w": torch.randn(1 << 18, device=device), "b": torch.randn(33, device=device)}
    ckptstream.save(old, path, settings=SMALL)
    old_bytes = path.read_bytes()
    real_start = threading.Thread.start
    seen: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(("ckptstream-write-", "ckptstream-read-")):  # the I/O threads
            seen.append(thread.name)
            if len(seen) > started:
                raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    new = {k: torch.randn_like(v) for k, v in old.items()}
    with pytest.raises(ckptstream.ThreadStartError, match=f"I/O thread {started + 1} of 3 for {path}") as e:
        ckptstream.save(new, path, settings=SMALL)
    assert repr(e.value.__cause__) == "RuntimeError(\"can't start new thread\")"
    assert engine_threads() == []
    assert POOL.in_use == 0
    assert path.read_bytes() == old_bytes
    assert sorted(tmp_path.iterdir()) == [path]
    seen.clear()
    with pytest.raises(ckptstream.ThreadStartError, match=f"I/O thread {started + 1} of 3 for {path}"):
        ckptstream.load(path, device=str(device), mmap=False, settings=SMALL)
    assert engine_threads() == []
    assert POOL.in_use == 0
    monkeypatch.undo()
    loaded = ckptstream.load(path, device=str(device), mmap=False, settings=SMALL)
    assert all(torch.equal(loaded[k], old[k]) for k in old)
