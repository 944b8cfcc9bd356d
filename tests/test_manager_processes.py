"""CheckpointManager across processes: a fork while a save is in flight, ranks agreeing through
files when one is slow to look, one writer per rank of a directory (a lock that a SIGKILL
frees), and a rank that never saves (files and a gloo group)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from tests.helpers import child_env
from tests.resume.trainutil import HERE, free_port

pytestmark = pytest.mark.usefixtures("no_save_left_behind")

Spawn = Callable[..., "subprocess.Popen[str]"]


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3000, generator=g), "step": step}


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts ``tests/resume/<script>`` in a session of its own; at the end of the test (also
    when it timed out) the whole session is killed: a child that hangs, and what it forked."""
    children: list[subprocess.Popen[str]] = []

    def start(script: str, *args: str) -> subprocess.Popen[str]:
        child = subprocess.Popen([sys.executable, str(HERE / script), *args], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                                 start_new_session=True)
        children.append(child)
        return child

    yield start
    for child in children:
        with contextlib.suppress(ProcessLookupError):  # ended already, with all it forked
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()


def report_of(child: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's JSON report (only the pytest timeout bounds the wait)."""
    out, err = child.communicate()
    assert child.returncode == 0, f"exit status {child.returncode}:\n{out}\n{err}"
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    report["stderr"] = err
    return report


# --- a forked child owns none of its parent's saves ------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["wait", "close", "exit", "linger"])
def test_a_forked_child_leaves_its_parents_manager_alone(variant: str, tmp_path: Path, spawn: Spawn) -> None:
    """The child waits for none of the parent's saves (it ends while the parent's save is held
    back until it has ended), and never releases nor keeps the parent's lock."""
    report = report_of(spawn("child_fork_manager.py", str(tmp_path), variant))
    assert report["status"] == 0, report
    assert report["save_waited_for_child"] is True, report  # the save was in flight all along
    assert report["saved"] is True, report
    if variant != "linger":
        assert report["lock_held_after_child"] is True, report
    assert report["lock_free_after_close"] is True, report
    assert report["steps"] == ([1, 2, 3] if variant == "linger" else [1, 2]), report
    assert report["loaded"] is True, report
    assert "waiting for the background save" not in report["stderr"], report["stderr"]


# --- ranks agreeing through files: nobody waits for a step that is gone ---------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("keep", "max_in_flight"), [(1, 2), (2, 3)])
def test_a_slow_rank_sees_every_outcome_before_rank_0_deletes_it(keep: int, max_in_flight: int, tmp_path: Path,
                                                                  spawn: Spawn) -> None:
    """Rank 1 looks for step 1's outcome only once rank 0 has gone as far as it can (deleted
    step 1, or waits for rank 1 at a later step whose file rank 1 has written): rank 0 must be
    waiting, and every step complete on both ranks."""
    directory, signals = tmp_path / "ckpts", tmp_path / "signals"
    directory.mkdir()
    signals.mkdir()
    args = (str(directory), str(signals), str(keep), str(max_in_flight))
    children = [spawn("child_race.py", str(rank), *args) for rank in (0, 1)]
    reports = [report_of(child) for child in children]
    last = max_in_flight + 1
    for rank in (1, 0):  # rank 1 first: its step 1 is the one at stake
        report = reports[rank]
        assert [report[str(s)] for s in range(1, last + 1)] == ["ok"] * last, (rank, report)
        assert report["steps"] == list(range(last - keep + 1, last + 1)), (rank, report)
        assert report["loaded"] is True
    assert "rank-0-waits-with-rank-1s-file-there" in reports[1]["signals"], reports[1]
    for step in range(last - keep + 1, last + 1):
        folder = directory / f"step-{step:012d}"
        assert sorted(p.name for p in folder.iterdir()) == [
            "DONE", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]


# --- one writer per rank of a directory -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_second_writer_is_refused_and_a_killed_writers_lock_is_free(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn("child_writer.py", str(tmp_path))
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        reader = ckptstream.CheckpointManager(tmp_path, keep=3)
        # reading needs no lock
        assert (reader.steps(), reader.latest_step()) == ([1], 1)
        assert torch.equal(reader.load()["w"], torch.arange(1000, dtype=torch.float32))
        assert reader.path() == str(tmp_path / "step-000000000001" / "state.safetensors")
        for write in (lambda: reader.save(state(2), 2), lambda: reader.delete(1)):
            with pytest.raises(ckptstream.DirectoryLockedError) as info:
                write()
            message = str(info.value)
            assert f"process {child.pid} on host {socket.gethostname()!r}" in message, message
            for part in ("rank 0", str(tmp_path), "reading (latest_step, steps, load, path) needs no lock"):
                assert part in message, message
            assert info.value.holder["pid"] == child.pid
            assert isinstance(info.value, RuntimeError)
        assert reader.steps() == [1]
        assert not (tmp_path / "step-000000000002").exists()
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    reader.save(state(2), 2, blocking=True)  # the kernel released the killed writer's lock
    # one writer per rank, also within a process; reading managers are fine
    other = ckptstream.CheckpointManager(tmp_path, keep=3)
    assert other.steps() == [1, 2]
    with pytest.raises(ckptstream.DirectoryLockedError, match=f"process {os.getpid()} "):
        other.save(state(3), 3)
    reader.close()
    other.save(state(3), 3, blocking=True)
    assert other.steps() == [1, 2, 3]
    other.close()


@pytest.mark.timeout(120)
def test_ranks_of_one_run_each_lock_their_own_rank(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn("child_writer.py", str(tmp_path), "1", "2")
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(ckptstream.DirectoryLockedError, match=f"as rank 1: process {child.pid} "):
            ckptstream.CheckpointManager(tmp_path, rank=1, world_size=2)  # cleans up when made: a writer
        rank0 = ckptstream.CheckpointManager(tmp_path, rank=0, world_size=2)
        single = ckptstream.CheckpointManager(tmp_path)
        with pytest.raises(ckptstream.DirectoryLockedError, match="as rank 0"):
            single.save(state(1), 1)
        rank0.close()
        single.close()
    finally:
        child.kill()
        child.communicate()
    ckptstream.CheckpointManager(tmp_path, rank=1, world_size=2).close()


@pytest.mark.timeout(180)
def test_group_ranks_refused_a_lock_all_raise(tmp_path: Path, spawn: Spawn) -> None:
    """Another process writes as rank 1: making the managers of a gloo run raises on both ranks
    (rank 0 does not wait in a collective for rank 1)."""
    writer = spawn("child_writer.py", str(tmp_path), "1", "2")
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    port = str(free_port())
    children = [spawn("child_group_timeout.py", str(r), str(tmp_path), port, "locked") for r in (0, 1)]
    rank0, rank1 = (report_of(child) for child in children)
    assert rank1["result"] == "DirectoryLockedError", rank1
    assert f"process {writer.pid} " in rank1["message"], rank1
    assert rank0["result"] == "IncompleteCheckpointError", rank0
    assert rank0["message"].startswith(f"the manager of {tmp_path} cannot write: rank 1: DirectoryLockedError: "), rank0


# --- a rank that never saves ----------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_files_a_rank_that_never_saves_times_out(rank: int, tmp_path: Path, spawn: Spawn) -> None:
    """Only the pytest timeout bounds this test: the manager's timeout of 1 s ends the wait."""
    report = report_of(spawn("child_lonely_rank.py", str(tmp_path), str(rank)))
    assert report["result"] == "CheckpointTimeoutError", report
    assert report["timeout"] is True, report
    assert report["incomplete"] is True, report
    waited = "rank(s) [1] to save it" if rank == 0 else "rank 0's DONE marker"
    assert f"rank {rank} waited 1 s (the manager's timeout) for {waited}" in report["message"], report
    assert report["steps"] == []
    failed = tmp_path / "step-000000000001" / "FAILED-rank-00000"
    assert failed.exists() == (rank == 0)  # rank 0 tells the ranks that did save to stop waiting


@pytest.mark.timeout(180)
def test_group_a_rank_that_never_saves_times_out(tmp_path: Path, spawn: Spawn) -> None:
    """Only the pytest timeout bounds this test: the manager's gloo group gives up after 1 s."""
    port = str(free_port())
    children = [spawn("child_group_timeout.py", str(rank), str(tmp_path), port, "silent") for rank in (0, 1)]
    report, _ = (report_of(child) for child in children)
    assert report["result"] == "CheckpointTimeoutError", report
    assert report["timeout"] is True, report
    assert report["incomplete"] is True, report
    assert "rank 0 waited 1 s (the manager's timeout) sending its outcome" in report["message"], report
    assert report["steps"] == []


# --- exiting with a refused save's report in flight ------------------------------------------------

WAITING = "ckptstream: waiting to tell the other ranks that the save of step 1 in "


@pytest.mark.timeout(180)
def test_a_refused_save_of_a_manager_kept_in_no_variable_exits_normally(tmp_path: Path, spawn: Spawn) -> None:
    """Rank 0's manager refuses a DTensor and the process ends at once: its report of the refusal
    to rank 1 (a gloo collective, in a thread) is still waiting for rank 1 then. Exit waits for it,
    and says so, before the interpreter shuts down: a thread still inside a collective then
    aborts the process once the collective returns. Rank 1 saves only once rank 0 waits."""
    rank0, rank1 = (spawn("child_refused_exit.py", str(rank), "2", str(tmp_path)) for rank in (0, 1))
    assert rank0.stdout is not None
    assert rank0.stderr is not None
    assert rank1.stdin is not None
    assert rank0.stdout.readline().strip() == "refused"
    lines = []
    for line in rank0.stderr:  # its first word after the refusal: waiting, or the interpreter's last hook
        lines.append(line)
        if line.startswith((WAITING, "at exit:")):
            break
    assert lines, "rank 0 ended without a word"
    assert lines[-1].startswith(WAITING), "".join(lines)
    assert f"{tmp_path / 'ckpts'} failed before exiting" in lines[-1], lines[-1]
    rank1.stdin.write("go\n")
    rank1.stdin.flush()
    _, err0 = rank0.communicate()  # (what rank 0 said before is read above: nothing is in a buffer)
    out1, err1 = rank1.communicate()
    assert (rank0.returncode, rank1.returncode) == (0, 0), f"{err0}\n{err1}"
    assert err0.splitlines()[-1] == "at exit: 0 manager thread(s) running", err0
    assert out1.split() == ["made", "refused"], out1
    assert err1.splitlines()[-1] == "at exit: 0 manager thread(s) running", err1
    assert not (tmp_path / "ckpts" / "step-000000000001" / "DONE").exists()


@pytest.mark.timeout(120)
def test_a_refused_save_of_one_rank_exits_normally(tmp_path: Path, spawn: Spawn) -> None:
    """The same with a group of one rank, which has nobody to wait for: silent, status 0."""
    child = spawn("child_refused_exit.py", "0", "1", str(tmp_path))
    out, err = child.communicate()
    assert child.returncode == 0, err
    assert out.split() == ["refused"], out
    assert err.splitlines()[-1] == "at exit: 0 manager thread(s) running", err
    assert "ckptstream:" not in err, err  # nobody else waits: nothing to say
