"""CheckpointManager: complete-only listing, keep-K, leftovers, crashes (a real SIGKILL at each
stage of a save) and several ranks (a gloo process group, and files only)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._checkpoint import save, save_async
from ckptstream._engine.write import WriteEngine
from ckptstream._storage import storage_for
from tests.helpers import random_tensor
from tests.memstore import Crash, MemStorage, Step
from tests.resume.trainutil import differences, free_port, start_child
from tests.storages import Place

pytestmark = pytest.mark.usefixtures("no_save_left_behind")



def state(version: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
            "optim": {"state": {0: {"step": torch.tensor(float(version))}}}, "step": version}


def poisoned(version: int) -> dict[str, Any]:
    """``state(version)``'s shapes and dtypes, every tensor NaN, every value wrong."""
    like = state(version)
    return {"model": {k: torch.full_like(v, float("nan")) for k, v in like["model"].items()},
            "optim": {"state": {0: {"step": torch.tensor(float("nan"))}}}, "step": -1}


def test_a_reader_of_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "runs" / "ckpts"
    with ckptstream.CheckpointManager(directory) as ckpts:
        assert ckpts.steps() == []
        assert ckpts.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpts.load()
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpts.load_into(poisoned(1))
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpts.path()
    assert list(tmp_path.iterdir()) == []
    with ckptstream.CheckpointManager(directory) as ckpts:  # the first save makes it
        ckpts.save(state(1), 1, blocking=True)
        assert ckpts.steps() == [1]
    assert differences(ckptstream.CheckpointManager(directory).load(), state(1)) == []


def entries(directory: Path) -> list[str]:
    """The entries of a folder, but a manager directory's lock files."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".lock-rank-"))


def listed(folder: str) -> list[str]:
    """``entries`` of a folder of any storage (a path, or a URL)."""
    return [e.name for e in storage_for(folder).list_folder(folder) if not e.name.startswith(".lock-rank-")]


def test_keep_the_newest_complete_checkpoints(place: Place) -> None:
    directory = place.path("ckpts")
    storage = storage_for(directory)
    with ckptstream.CheckpointManager(directory, keep=2) as ckpts:
        assert (ckpts.steps(), ckpts.latest_step()) == ([], None)
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpts.load()
        handles = [ckpts.save(state(step), step) for step in (10, 20, 30)]
        ckpts.wait()
        assert [h.step for h in handles] == [10, 20, 30]
        assert all(h.done() for h in handles)
        assert ckpts.steps() == [20, 30]
        assert ckpts.latest_step() == 30
        assert listed(directory) == ["step-000000000020", "step-000000000030"]
        folder = storage.join(directory, "step-000000000030")
        assert listed(folder) == ["DONE", "state.safetensors"]
        assert differences(ckpts.load(20), state(20)) == []
        assert differences(ckpts.load(), state(30)) == []
        target = poisoned(30)
        assert differences(ckpts.load_into(target), state(30)) == []
        assert differences(target["model"], state(30)["model"]) == []  # filled in place
        assert ckpts.path() == handles[-1].path == storage.join(folder, "state.safetensors")
        done = json.loads(storage.read_small(storage.join(folder, "DONE"), 1 << 16))
        assert done["step"] == 30
        assert done["world_size"] == 1
        assert done["files"] == {"state.safetensors": storage.size(ckpts.path())}
        handle = ckpts.save(state(40), 40, blocking=True)
        assert handle.done()
        assert ckpts.steps() == [30, 40]
    assert listed(directory) == ["step-000000000030", "step-000000000040"]


def test_only_complete_checkpoints_count_and_leftovers_go(tmp_path: Path) -> None:
    with ckptstream.CheckpointManager(tmp_path, keep=3) as ckpts:
        ckpts.save(state(3), 3, blocking=True)
    good = tmp_path / "step-000000000003"
    for step, done in ((7, None), (8, "{not json"), (9, "wrong size")):
        folder = tmp_path / f"step-{step:012d}"
        folder.mkdir()
        (folder / "state.safetensors").write_bytes((good / "state.safetensors").read_bytes())
        if done == "wrong size":
            record = json.loads((good / "DONE").read_text())
            record["files"]["state.safetensors"] += 1
            done = json.dumps(record)
        if done is not None:
            (folder / "DONE").write_text(done)
    (tmp_path / "step-000000000009" / ".state.safetensors.ckptstream-tmp-host-1-2-0123456789ab").write_bytes(b"x")
    (tmp_path / "step-000000000008" / ".DONE.ckptstream-tmp-host-1-2-0123456789ab").write_bytes(b"x")  # not this rank's
    (tmp_path / "step-notanumber").mkdir()
    (tmp_path / "step-000000000010").write_text("a file, not a step folder")
    ckpts = ckptstream.CheckpointManager(tmp_path, keep=3)
    assert ckpts.steps() == [3]
    assert ckpts.latest_step() == 3
    assert len(entries(tmp_path)) == 6
    ckpts.save(state(11), 11, blocking=True)  # complete: the older incomplete steps go
    assert ckpts.steps() == [3, 11]
    assert entries(tmp_path) == ["step-000000000003", "step-000000000010", "step-000000000011", "step-notanumber"]
    ckpts.close()
    ckpts.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        ckpts.save(state(12), 12)


def test_steps_increase_and_delete_rolls_back(place: Place) -> None:
    directory = place.path("ckpts")
    with ckptstream.CheckpointManager(directory, keep=None) as ckpts:
        for step in (1, 5, 9):
            ckpts.save(state(step), step)
        with pytest.raises(ValueError, match="step 5 is not after step 9"):
            ckpts.save(state(0), 5)
        ckpts.wait()
        ckpts.delete(9)
        assert listed(directory) == ["step-000000000001", "step-000000000005"]
        with pytest.raises(FileNotFoundError, match="no such checkpoint"):
            ckpts.delete(9)
        ckpts.save(state(6), 6, blocking=True)  # training resumed from 5 takes another road
        assert ckpts.steps() == [1, 5, 6]
        with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
            ckpts.load(9)
        assert differences(ckpts.load(6), state(6)) == []
        for bad in (-1, 2.0, True):
            with pytest.raises(ValueError, match="step must be an integer"):
                ckpts.save(state(0), bad)  # type: ignore[arg-type]
    for kwargs, message in (({"keep": 0}, "keep must be"), ({"mode": "disk"}, "mode must be"),
                            ({"max_in_flight": 0}, "max_in_flight must be"),
                            ({"rank": 2, "world_size": 2}, "rank must be"), ({"rank": 1}, "needs world_size")):
        with pytest.raises(ValueError, match=message):
            ckptstream.CheckpointManager(directory, **kwargs)


def test_a_step_that_is_complete_is_never_saved_again(place: Place) -> None:
    directory = place.path("ckpts")
    with ckptstream.CheckpointManager(directory, keep=None) as ckpts:
        ckpts.save(state(9), 9, blocking=True)
        with pytest.raises(ValueError, match="step 9 is not after step 9"):
            ckpts.save(state(0), 9)
    with ckptstream.CheckpointManager(directory, keep=None) as again:  # from the directory alone
        with pytest.raises(ValueError, match="step 9 is not after step 9"):
            again.save(state(0), 9)
        with pytest.raises(ValueError, match=r"step must be an integer in \[0, 999999999999\]"):
            again.save(state(0), 10**12)  # its folder's name would not be a step's
        again.save(state(1), 10**12 - 1, blocking=True)
        assert again.steps() == [9, 10**12 - 1]
    assert differences(again.load(9), state(9)) == []


def test_only_the_managers_names_are_steps_and_only_its_files_are_removed(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    directory, outside = tmp_path / "ckpts", tmp_path / "outside"
    with ckptstream.CheckpointManager(directory, keep=1) as ckpts:
        ckpts.save(state(3), 3, blocking=True)
    good = directory / "step-000000000003"
    # complete-looking folders under names the manager does not write, and a link to one
    odd = ["step-1", "step-0005", "step-\u0661\u0662", "step-0000000000007", "step-00000000001x", "Step-000000000004"]
    for name in [*odd, "outside"]:
        folder = tmp_path / "outside" if name == "outside" else directory / name
        folder.mkdir()
        for entry in ("DONE", "state.safetensors"):
            (folder / entry).write_bytes((good / entry).read_bytes())
        (folder / "my-notes.txt").write_text(f"notes of {name}")
    (directory / "step-000000000002").symlink_to(outside)
    # an incomplete step of the manager's, with a file of the user's beside its leftovers
    mixed = directory / "step-000000000001"
    mixed.mkdir()
    (mixed / "state.safetensors").write_bytes(b"a leftover")
    (mixed / "FAILED-rank-00000").write_text("OSError: gone")
    (mixed / ".state.safetensors.ckptstream-tmp-host-1-2-0123456789ab").write_bytes(b"x")
    (mixed / "my-notes.txt").write_text("mine")
    # every file but the manager's own writer lock (which each writing manager rewrites)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*")
              if p.is_file() and not p.is_symlink() and not p.name.startswith(".lock-rank-")}
    with ckptstream.CheckpointManager(directory, keep=1) as ckpts:
        assert ckpts.steps() == [3]
        assert [c.step for c in ckptstream.check_steps(directory)] == [1, 3]
        assert ckptstream.check_step(directory / "step-0005").step is None
        caplog.clear()
        ckpts.save(state(4), 4, blocking=True)  # prunes 3 (keep=1) and the incomplete 1
        said = [(r.name, r.levelname, r.getMessage()[:200]) for r in caplog.records]
        assert ckpts.steps() == [4]
        assert entries(mixed) == ["my-notes.txt"]
        kept = f"kept the folder {mixed}: it holds files the manager did not write (my-notes.txt)"
        assert [(name, level) for name, level, m in said if m.startswith(kept)] == [("ckptstream", "WARNING")], said
        caplog.clear()
        ckpts.save(state(5), 5, blocking=True)  # the folder of the user's file alone: left, unsaid
        assert caplog.records == []
        # delete() of a step holding a file of the user's: the checkpoint goes, the folder stays
        (directory / "step-000000000005" / "my-notes.txt").write_text("mine too")
        ckpts.delete(5)
        assert f"kept the folder {directory / 'step-000000000005'}" in caplog.text
        assert ckpts.steps() == []
        assert entries(directory / "step-000000000005") == ["my-notes.txt"]
        with pytest.raises(FileNotFoundError, match="no such checkpoint"):
            ckpts.delete(2)  # the link
    assert entries(directory) == sorted([*odd, "step-000000000001", "step-000000000002", "step-000000000005"])
    for path, data in before.items():
        if path.parent not in (mixed, good):
            assert path.read_bytes() == data, path
    assert os.path.islink(directory / "step-000000000002")


def test_a_failed_save_does_not_count(place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = place.path("ckpts")
    storage = storage_for(directory)
    ckpts = ckptstream.CheckpointManager(directory, keep=2, settings=Settings(buffer_size=4096, num_buffers=2))
    ckpts.save(state(1), 1, blocking=True)
    real, count = WriteEngine._write, [0]

    def failing(self: WriteEngine, chunk: Any, buf: Any) -> None:
        count[0] += 1
        if count[0] > 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self.file.name)
        real(self, chunk, buf)

    monkeypatch.setattr(WriteEngine, "_write", failing)
    handle = ckpts.save(state(2), 2)
    with pytest.raises(OSError, match="No space left"):
        handle.result()
    assert ckpts.latest_step() == 1
    assert listed(storage.join(directory, "step-000000000002")) == []  # nothing left of the save
    ckpts.wait()  # collected already: not raised again
    uncollected = ckpts.save(state(3), 3)
    while not uncollected.done():
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):
        ckpts.close()  # nobody asked: close says it
    monkeypatch.undo()
    with ckptstream.CheckpointManager(directory, keep=2) as again:
        assert again.steps() == [1]
        again.save(state(4), 4)
    assert again.steps() == [1, 4]
    assert listed(directory) == ["step-000000000001", "step-000000000004"]
    assert not [n for n in place.names() if "tmp" in n or n.startswith("pending:")]  # no unfinished write left


def test_saved_by_another_number_of_ranks(place: Place) -> None:
    directory = place.path("ckpts")
    with ckptstream.CheckpointManager(directory) as ckpts:
        ckpts.save(state(1), 1, blocking=True)
    two = ckptstream.CheckpointManager(directory, rank=0, world_size=2)
    with pytest.raises(ckptstream.StateMismatchError, match="saved by 1 process"):
        two.load()
    assert two.path(rank=0) == storage_for(directory).join(directory, "step-000000000001", "state.safetensors")
    two.close()


def test_two_ranks_through_files_on_any_storage(place: Place) -> None:
    """Two ranks (threads of one process) agree through READY and DONE markers and prune
    together; each loads its own file."""
    directory = place.path("ckpts")
    ranks = [ckptstream.CheckpointManager(directory, rank=r, world_size=2, keep=1, max_in_flight=2, timeout=60)
             for r in (0, 1)]
    try:
        for step in (1, 2, 3):
            for handle in [m.save(state(10 * r + step), step) for r, m in enumerate(ranks)]:
                handle.result()
        assert [m.steps() for m in ranks] == [[3], [3]]
        for r, m in enumerate(ranks):
            assert differences(m.load(), state(10 * r + 3)) == []
        folder = storage_for(directory).join(directory, "step-000000000003")
        assert listed(folder) == ["DONE", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    finally:
        for m in ranks:
            m.close()


def test_lazy_mode_manager_and_a_device_state(tmp_path: Path, device: torch.device) -> None:
    w = random_tensor((1024, 512), device=device)  # 2 MiB: on the CPU too, streamed from the live tensor
    expected = w.cpu().clone()
    with ckptstream.CheckpointManager(tmp_path, mode="lazy") as ckpts:
        handle = ckpts.save({"w": w}, 1)
        handle.wait_staged()
        w.zero_()
    assert torch.equal(ckpts.load(1)["w"], expected)
    assert torch.equal(ckpts.load(1, device=device)["w"].cpu(), expected)


def test_a_shorter_holder_replaces_a_longer_ones_record(tmp_path: Path) -> None:
    """The lock file holds its last holder's record alone: a shorter record after a longer one
    reads back whole, not followed by the longer one's tail."""
    storage = storage_for(str(tmp_path))
    lock_file = tmp_path / ".lock-rank-00000"
    longer = json.dumps({"host": "h" * 300, "pid": 1, "since": "2020-01-01T00:00:00",
                         "note": os.urandom(300).hex()}).encode()
    storage.lock(str(lock_file), longer).close()
    assert lock_file.read_bytes() == longer
    with ckptstream.CheckpointManager(tmp_path) as first, ckptstream.CheckpointManager(tmp_path) as second:
        first.save(state(1), 1, blocking=True)
        with pytest.raises(ckptstream.DirectoryLockedError) as info:
            second.save(state(2), 2)
        record = lock_file.read_bytes()
    holder = info.value.holder
    assert (sorted(holder), holder.get("pid"), holder.get("host")) == (["host", "id", "pid", "since"], os.getpid(),
                                                                      socket.gethostname())
    assert record == json.dumps(holder).encode()
    assert f"process {os.getpid()} on host {socket.gethostname()!r}" in str(info.value)


# --- killed for real ---------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["streaming", "published", "pruning"])
def test_sigkill_during_a_save_leaves_the_previous_step(point: str, tmp_path: Path) -> None:
    child = start_child("child_kill.py", str(tmp_path), point)
    assert child.stdout is not None
    lines = []
    deadline = time.monotonic() + 120
    while point not in lines and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=60)
    assert lines == ["ready", point], err
    assert child.returncode == -signal.SIGKILL

    ckpts = ckptstream.CheckpointManager(tmp_path, keep=1)
    expected_latest = 2 if point == "pruning" else 1
    assert ckpts.latest_step() == expected_latest
    loaded = ckpts.load(1)
    v = torch.arange(1 << 18, dtype=torch.float32)
    assert torch.equal(loaded["w"], v)
    assert loaded["step"] == 1
    if point == "pruning":
        assert ckpts.steps() == [1, 2]
        assert torch.equal(ckpts.load()["w"], v * 2)
    ckpts.save({"w": v * 3, "step": 3}, 3, blocking=True)
    assert ckpts.steps() == [3]
    assert entries(tmp_path) == ["step-000000000003"]
    assert entries(tmp_path / "step-000000000003") == ["DONE", "state.safetensors"]
    ckpts.close()


# --- crashes and faults on the in-memory storage ---------------------------------------------------


@pytest.mark.parametrize("point", ["streaming", "rank file", "DONE"])
def test_a_crash_during_a_save_leaves_the_previous_step(point: str, mem: MemStorage) -> None:
    """The process dies (``Crash``: nothing of it runs on) while step 2 streams, as its file is
    published, or as its DONE marker is: the next process finds step 1 the newest, its lock free
    and the dead save's leftovers (an unfinished upload, a file) removed with step 2's folder."""
    directory = "mem://test/ckpts"
    ckpts = ckptstream.CheckpointManager(directory, keep=1, settings=Settings(buffer_size=4096, num_buffers=2))
    ckpts.save(state(1), 1, blocking=True)
    writes, publishes = mem.calls["write"], mem.calls["publish"]
    crashes: dict[str, tuple[Step, int]] = {"streaming": ("write", writes + 3), "rank file": ("publish", publishes + 1),
                                            "DONE": ("publish", publishes + 2)}
    mem.faults.crash = crashes[point]
    with pytest.raises(Crash):
        ckpts.save(state(2), 2, blocking=True)
    assert [s.name.rsplit("/", 1)[1] for s in mem.pending.values()] == [
        "DONE" if point == "DONE" else "state.safetensors"]
    mem.faults.crash = None
    with pytest.raises(ckptstream.DirectoryLockedError, match=f"process {os.getpid()} on host"):
        ckptstream.CheckpointManager(directory).save(state(3), 3)  # the dead process holds it, yet
    mem.restart()
    with ckptstream.CheckpointManager(directory, keep=1) as again:
        assert again.steps() == [1]
        assert differences(again.load(), state(1)) == []
        again.save(state(3), 3, blocking=True)  # prunes step 1, and step 2 with the dead save's leftovers
        assert again.steps() == [3]
    assert listed(directory) == ["step-000000000003"]
    assert mem.pending == {}


def test_a_failed_done_publish_fails_the_step_and_keeps_the_previous(mem: MemStorage) -> None:
    directory = "mem://test/ckpts"
    with ckptstream.CheckpointManager(directory, keep=1) as ckpts:
        ckpts.save(state(1), 1, blocking=True)
        mem.faults.fail_publish = "/DONE"  # the rank file publishes; its DONE marker does not
        with pytest.raises(OSError, match=r"Input/output error \(injected\).*step-000000000002/DONE"):
            ckpts.save(state(2), 2, blocking=True)
        mem.faults.fail_publish = False
        assert ckpts.steps() == [1]  # not pruned: step 2 never completed
        assert listed(directory) == ["step-000000000001", "step-000000000002"]
        ckpts.save(state(3), 3, blocking=True)
        assert ckpts.steps() == [3]
    assert listed(directory) == ["step-000000000003"]
    assert mem.pending == {}


# --- several ranks -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["group", "files"])
def test_two_ranks_complete_a_step_only_together(how: str, tmp_path: Path) -> None:
    """Step 3 fails on rank 1 after its file is in place (the step folder's fsync): no rank
    counts it. With "group", numpy cannot be imported. A restart keeps the complete steps."""
    port = str(free_port())
    children = [start_child("child_ranks.py", how, str(rank), str(tmp_path), port) for rank in (0, 1)]
    reports = []
    for rank, child in enumerate(children):
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, f"rank {rank}:\n{out}\n{err}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for rank, report in enumerate(reports):
        assert (report["1"], report["2"]) == ("ok", "ok"), reports
        assert report["3"] == ("IncompleteCheckpointError" if rank == 0 else "OSError"), json.dumps(reports)
        assert (report["steps"], report["latest"], report["loaded"]) == ([1, 2], 2, True), report
        assert report["files"] == ["DONE", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
        assert report["restart_steps"] == [1, 2], report
        assert report["numpy"] is (how == "files"), report
        if how == "group":  # rank 0 removes the incomplete steps when the managers are made
            assert report["step3_left"] is False, report
    assert reports[0]["incomplete_while_rank1_writes"] is True
    after = ckptstream.CheckpointManager(tmp_path, rank=1, world_size=2)
    assert after.steps() == [1, 2]
    assert after.load(1)["rank"] == 1
    after.close()


def test_saves_in_flight_together_complete_in_step_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = save.write_checkpoint

    def first_is_late(plan: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if "step-000000000001" in path:
            time.sleep(0.5)
        real(plan, path, *args, **kwargs)

    monkeypatch.setattr(save_async, "write_checkpoint", first_is_late)
    with ckptstream.CheckpointManager(tmp_path, keep=1, max_in_flight=2) as ckpts:
        first, second = ckpts.save(state(1), 1), ckpts.save(state(2), 2)
        assert second.result()
        assert first.done()
        assert first.result()
        assert ckpts.steps() == [2]
    assert entries(tmp_path) == ["step-000000000002"]
