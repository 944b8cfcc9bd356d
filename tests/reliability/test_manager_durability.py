"""Durability of a CheckpointManager, shown on the real calls it makes (recorded as
test_durability records ``save``'s, plus every unlink, rmdir and mkdir): a step counts only once
every rank's file is durable, and its DONE marker is published as a file is (temp, fsync,
rename, folder fsync); a step is deleted (``delete``, pruning) DONE first, durably, before any
other file goes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._storage import publish
from ckptstream._storage.local import LocalStorage
from tests.reliability.test_durability import Trace, where

pytestmark = pytest.mark.usefixtures("no_save_left_behind")


class ManagerTrace(Trace):
    """``Trace``, and also each unlink, rmdir and mkdir, with its path (a ``dir_fd`` resolved)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch)
        for name in ("unlink", "rmdir", "mkdir"):
            monkeypatch.setattr(os, name, self._path_call(name, getattr(os, name)))

    def _path_call(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> Any:
            if dir_fd is None:
                full = os.path.abspath(os.fsdecode(path))
                result = real(path, *args, **kwargs)
            else:
                full = os.path.join(where(dir_fd), os.fsdecode(path))
                result = real(path, *args, dir_fd=dir_fd, **kwargs)
            with self._lock:
                self.events.append((name, full))
            return result

        return call

    def note(self, *event: Any) -> None:
        """Record an event of a layer above the system calls (a storage's method)."""
        with self._lock:
            self.events.append(event)

    def find(self, *event: Any, last: bool = False) -> int:
        return self.index(lambda e: e == event, last)

    def all(self, test: Callable[[tuple[Any, ...]], bool]) -> list[int]:
        return [i for i, e in enumerate(self.events) if test(e)]


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(70_001, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "step": seed}


OPTS: dict[str, Any] = {"buffer_size": 64 << 10, "num_buffers": 3, "io_threads": 2}


def check_file_published(trace: ManagerTrace, target: str) -> int:
    """Written only as a temp beside ``target``, fsynced, renamed over it, its folder fsynced;
    returns the index of the rename."""
    events, folder = trace.events, os.path.dirname(target)
    renames = trace.all(lambda e: e[0] == "rename" and e[2] == target)
    assert renames, f"{target} is not renamed into place from a temp (written in place?)"
    assert len(renames) == 1, [events[i] for i in renames]
    temp = events[renames[0]][1]
    assert os.path.dirname(temp) == folder
    assert os.path.basename(temp).startswith(f".{os.path.basename(target)}{publish.TEMP_MARK}")
    assert not trace.all(lambda e: e[0] in ("write", "truncate") and e[1] == target), f"{target} written in place"
    assert not trace.all(lambda e: e[0] == "open" and e[1] == target and e[2] & (os.O_WRONLY | os.O_RDWR))
    writes = trace.all(lambda e: e[0] in ("write", "truncate") and e[1] == temp)
    syncs = [i for i in trace.all(lambda e: e == ("sync", temp)) if i < renames[0]]
    assert writes, f"{temp} is never written"
    assert syncs, f"{temp} is not fsynced before its rename"
    assert writes[-1] < syncs[-1], f"{temp} is written after its last fsync"
    assert [i for i in trace.all(lambda e: e == ("sync", folder)) if i > renames[0]], \
        f"{folder} is not fsynced after {target} is renamed into it"
    return renames[0]


def check_step_published(trace: ManagerTrace, directory: str, step: int, rank_files: list[str]) -> int:
    """Every rank file durable, then the step folder and its parent fsynced, then DONE published
    (temp, fsync, rename, folder fsync); returns the index of DONE's rename."""
    folder = os.path.join(directory, f"step-{step:012d}")
    done = os.path.join(folder, "DONE")
    made = trace.find("mkdir", folder)
    renamed = [check_file_published(trace, os.path.join(folder, name)) for name in rank_files]
    published = check_file_published(trace, done)
    folder_syncs = trace.all(lambda e: e == ("sync", folder))
    durable = max(min(i for i in folder_syncs if i > r) for r in renamed)  # each rank file's rename
    done_temp = trace.index(lambda e: e[0] == "open" and os.path.basename(e[1]).startswith(
        f".DONE{publish.TEMP_MARK}") and os.path.dirname(e[1]) == folder)
    assert durable < done_temp, "DONE is begun before every rank file's rename is durable"
    parent = [i for i in trace.all(lambda e: e == ("sync", directory)) if made < i < done_temp]
    assert parent, "the step folder's entry in its parent is not fsynced before DONE is begun"
    own = [i for i in folder_syncs if max(renamed) < i < done_temp]
    assert own, "the step folder is not fsynced (after the last rank file) before DONE is begun"
    return published


def check_step_removed(trace: ManagerTrace, directory: str, step: int, after: int = -1) -> None:
    """DONE unlinked first, the folder fsynced, then the other files, the folder, its parent
    fsynced; nothing of the step touched before ``after``."""
    folder = os.path.join(directory, f"step-{step:012d}")
    inside = trace.all(lambda e: e[0] == "unlink" and os.path.dirname(e[1]) == folder)
    assert inside, f"nothing of {folder} is removed"
    first = inside[0]
    assert trace.events[first] == ("unlink", os.path.join(folder, "DONE")), \
        f"the first file removed is {trace.events[first][1]}, not DONE"
    assert first > after, "the step is removed before the newer step is durable"
    synced = [i for i in trace.all(lambda e: e == ("sync", folder)) if i > first]
    assert synced, "the folder is not fsynced after DONE is unlinked"
    assert len(inside) > 1, "only DONE is removed"
    assert synced[0] < inside[1], "another file is removed before DONE's removal is durable"
    gone = trace.find("rmdir", folder)
    assert gone > inside[-1]
    assert [i for i in trace.all(lambda e: e == ("sync", directory)) if i > gone], \
        "the directory is not fsynced after the step folder is removed"
    assert not os.path.exists(folder)


def test_one_process_save_prune_and_delete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = str(tmp_path)
    with ckptstream.CheckpointManager(tmp_path, keep=1, settings=Settings(**OPTS)) as ckpts:
        ckpts.save(state(1), 1, blocking=True)  # the lock is taken, the leftovers looked for
        trace = ManagerTrace(monkeypatch)
        ckpts.save(state(2), 2, blocking=True)  # publishes step 2, then prunes step 1
        monkeypatch.undo()
        done = check_step_published(trace, directory, 2, ["state.safetensors"])
        after = min(i for i in trace.all(lambda e: e == ("sync", os.path.join(directory, "step-000000000002")))
                    if i > done)
        check_step_removed(trace, directory, 1, after)
        assert ckpts.steps() == [2]
        trace = ManagerTrace(monkeypatch)
        ckpts.delete(2)
        monkeypatch.undo()
        check_step_removed(trace, directory, 2)
        assert ckpts.steps() == []


def test_two_ranks_through_files_publish_after_both_files_are_durable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 publishes DONE only after rank 1's file is renamed and its folder fsynced (in the
    same process: the ranks' saves run in their own threads)."""
    directory = str(tmp_path)
    ranks = [ckptstream.CheckpointManager(tmp_path, rank=r, world_size=2, keep=1, max_in_flight=2,
                                          settings=Settings(**OPTS))
             for r in (0, 1)]
    try:
        for step in (1, 2):
            if step == 2:
                trace = ManagerTrace(monkeypatch)
            handles = [m.save(state(10 * r + step), step) for r, m in enumerate(ranks)]
            for handle in handles:
                handle.result()
        monkeypatch.undo()
    finally:
        for m in ranks:
            m.close()
    names = [f"rank-0000{r}-of-00002.safetensors" for r in (0, 1)]
    done = check_step_published(trace, directory, 2, names)
    check_step_removed(trace, directory, 1, done)
    assert ckptstream.check_step(tmp_path / "step-000000000002").complete


def test_the_manager_makes_the_step_folder_durable_itself_before_done(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager itself asks its storage to make the step folder durable
    (``Storage.sync_folder``) after the last rank file is published and before DONE is begun,
    rather than count on each sink's publish to have fsynced the folder: a storage whose publish
    only renames (its contract asks for atomic, and ``sync_folder`` makes names durable) still
    gets DONE only over rank files whose names are on disk."""
    directory = str(tmp_path)
    folder = os.path.join(directory, "step-000000000002")
    with ckptstream.CheckpointManager(tmp_path, keep=None, settings=Settings(**OPTS)) as ckpts:
        ckpts.save(state(1), 1, blocking=True)
        trace = ManagerTrace(monkeypatch)
        real = LocalStorage.sync_folder

        def sync_folder(self: LocalStorage, path: str) -> None:
            real(self, path)
            trace.note("sync_folder", os.path.abspath(path))

        monkeypatch.setattr(LocalStorage, "sync_folder", sync_folder)
        ckpts.save(state(2), 2, blocking=True)
        monkeypatch.undo()
        assert ckpts.steps() == [1, 2]
    renamed = check_file_published(trace, os.path.join(folder, "state.safetensors"))
    done_temp = trace.index(lambda e: e[0] == "open" and os.path.dirname(e[1]) == folder
                            and os.path.basename(e[1]).startswith(f".DONE{publish.TEMP_MARK}"))
    asked = [i for i in trace.all(lambda e: e == ("sync_folder", folder)) if renamed < i < done_temp]
    assert asked, "the manager does not sync the step folder through its storage between the rank file and DONE"
    publishes = min(i for i in trace.all(lambda e: e == ("sync", folder)) if i > renamed)  # the sink's own
    assert [i for i in trace.all(lambda e: e == ("sync", folder)) if publishes < i < asked[0]], \
        "the storage's sync_folder does not fsync the step folder"
    check_step_published(trace, directory, 2, ["state.safetensors"])
