"""CheckpointManager over hostile step folders: a DONE marker that names paths out of the folder,
is a FIFO, a link, huge, deeply nested, malformed, or disagrees with its files. Each is an
incomplete step, with its reason (``check_step``): never listed, never an exception that stops
saving, and pruning it removes nothing outside the folder."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._manager import directory

pytestmark = pytest.mark.usefixtures("no_save_left_behind")

HOSTILE = 5  # the hostile step, after the good one: the newest, were it counted


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(777, generator=g), "step": step}


def record(files: dict[str, Any], world_size: int | None = None, step: int = HOSTILE, **extra: Any) -> bytes:
    done = {"format": directory.FORMAT, "step": step, "world_size": len(files) if world_size is None else world_size,
            "files": files, **extra}
    return json.dumps(done).encode()


class Setting:
    """A good step 1 saved by a manager, a file outside the directory, and a hostile step folder
    holding a copy of step 1's file."""

    def __init__(self, tmp_path: Path) -> None:
        self.directory = tmp_path / "ckpts"
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        self.secret = self.outside / "secret"
        self.secret.write_bytes(os.urandom(5000))
        with ckptstream.CheckpointManager(self.directory, keep=2) as ckpts:
            ckpts.save(state(1), 1, blocking=True)
        self.good = self.directory / "step-000000000001"
        self.folder = self.directory / f"step-{HOSTILE:012d}"
        self.folder.mkdir()
        self.file = self.folder / "state.safetensors"
        self.file.write_bytes((self.good / "state.safetensors").read_bytes())
        self.size = self.file.stat().st_size
        self.done = self.folder / "DONE"


def names(s: Setting, files: dict[str, Any]) -> None:
    s.done.write_bytes(record(files))


# (the DONE marker and folder a case makes, the reason check_step must give: a pattern, or the
# exact text made from the setting)
CASES: dict[str, tuple[Callable[[Setting], object], str | Callable[[Setting], str]]] = {
    "parent path": (lambda s: names(s, {"../../outside/secret": 5000}), r"names '../../outside/secret': a path"),
    "absolute path": (lambda s: names(s, {str(s.secret): 5000}), r"names '/.*/outside/secret': a path"),
    "subfolder": (lambda s: _subfolder(s), r"names 'sub/state.safetensors': a path"),
    "the marker itself": (lambda s: names(s, {"DONE": 10}), r"names 'DONE': not a file of a 1-rank step"),
    "another rank's name": (lambda s: names(s, {"state.safetensors": s.size, "notes.txt": 3}),
                            r"names 'state.safetensors': not a file of a 2-rank step"),
    "FIFO": (lambda s: os.mkfifo(s.done), r"DONE is not a regular file \(a symbolic link, a FIFO"),
    "link to a good DONE": (lambda s: s.done.symlink_to(s.good / "DONE"), r"DONE is not a regular file \(a symbolic"),
    "folder": (lambda s: s.done.mkdir(), r"DONE is a directory, not a regular file"),
    "200 MB": (lambda s: os.truncate(_touch(s.done), 200_000_000),
               r"DONE holds 200000000 bytes, more than the 8192 expected of it"),
    "nested 200000 deep": (lambda s: s.done.write_text("[" * 200_000 + "]" * 200_000),
                           r"DONE holds 400000 bytes, more than the 8192 expected of it"),
    "nested 4000 deep": (lambda s: s.done.write_text("[" * 4000 + "]" * 4000),
                         r"DONE is malformed: it holds 4000 brackets, a DONE marker at most 16 \(not parsed\)"),
    "not JSON": (lambda s: s.done.write_text("{not json"), r"DONE is malformed: not JSON"),
    "not UTF-8": (lambda s: s.done.write_bytes(b"\xff\xfe{}"), r"DONE is malformed: not JSON"),
    "another format": (lambda s: s.done.write_text('{"format": "other", "files": {}}'),
                       r"DONE is malformed: not a 'ckptstream-manager 1' record"),
    "a trillion ranks": (lambda s: s.done.write_bytes(record({"state.safetensors": s.size}, world_size=10**12)),
                         r"it records 1 file\(s\) for 1000000000000 rank\(s\)"),
    "a size that is a bool": (lambda s: names(s, {"state.safetensors": True}), r"not a map of names to sizes"),
    "a negative size": (lambda s: names(s, {"state.safetensors": -1}), r"not a map of names to sizes"),
    "another step": (lambda s: s.done.write_bytes(record({"state.safetensors": s.size}, step=999)),
                     r"DONE records step 999, the folder's name step 5"),
    # the file one byte shorter, and one byte longer, than DONE records
    "file shorter than DONE": (lambda s: names(s, {"state.safetensors": s.size + 1}),
                               lambda s: f"size mismatch of state.safetensors: DONE records {s.size + 1} bytes, "
                                         f"the file has {s.size}"),
    "file longer than DONE": (lambda s: names(s, {"state.safetensors": s.size - 1}),
                              lambda s: f"size mismatch of state.safetensors: DONE records {s.size - 1} bytes, "
                                        f"the file has {s.size}"),
    "rank file missing": (lambda s: _rank_file(s, None), r"state.safetensors is missing"),
    "rank file a link": (lambda s: _rank_file(s, s.secret), r"state.safetensors is not a regular file"),
    "no DONE, a rank failed": (lambda s: (s.folder / "FAILED-rank-00000").write_text("OSError: disk on fire\n"),
                               r"no DONE marker .*; rank 0 failed: OSError: disk on fire"),
}


def _subfolder(s: Setting) -> None:
    (s.folder / "sub").mkdir()
    (s.folder / "sub" / "state.safetensors").write_bytes(s.file.read_bytes())
    names(s, {"sub/state.safetensors": s.size})


def _rank_file(s: Setting, link_to: Path | None) -> None:
    """The rank file gone, or a link to a file of the recorded size in its place."""
    s.file.unlink()
    if link_to is not None:
        s.file.symlink_to(link_to)
    names(s, {"state.safetensors": 0 if link_to is None else link_to.stat().st_size})


def _touch(path: Path) -> Path:
    path.touch()
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_step_is_incomplete_and_never_stops_saving(case: str, tmp_path: Path) -> None:
    s = Setting(tmp_path)
    make, reason = CASES[case]
    make(s)
    secret = s.secret.read_bytes()
    check = ckptstream.check_step(s.folder)
    assert (check.step, check.complete) == (HOSTILE, False)
    assert check.problem is not None
    if callable(reason):
        assert check.problem == reason(s)
    else:
        assert re.search(reason, check.problem), check.problem
    with ckptstream.CheckpointManager(s.directory, keep=1) as ckpts:
        assert (ckpts.steps(), ckpts.latest_step()) == ([1], 1)
        assert [c.step for c in ckptstream.check_steps(s.directory) if not c.complete] == [HOSTILE]
        with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
            ckpts.path(HOSTILE)
        # saving goes on, and pruning removes the step's own files (DONE first), nothing outside
        ckpts.save(state(HOSTILE + 1), HOSTILE + 1, blocking=True)
        assert ckpts.steps() == [HOSTILE + 1]
        assert torch.equal(ckpts.load()["w"], state(HOSTILE + 1)["w"])
    assert s.secret.read_bytes() == secret
    assert not s.folder.exists() or [c.step for c in ckptstream.check_steps(s.directory)] == [HOSTILE, HOSTILE + 1]
    assert not s.good.exists()


def test_a_deep_done_is_refused_unparsed_whatever_its_size() -> None:
    """The bracket bound alone keeps json from recursing (the size bound comes first in a folder)."""
    for data in (b"[" * 200_000 + b"]" * 200_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        with pytest.raises(ValueError, match="brackets"):
            directory.parse_done(data)


def test_the_reasons_of_a_complete_step_and_of_odd_folders(tmp_path: Path) -> None:
    with ckptstream.CheckpointManager(tmp_path, rank=0, world_size=1) as ckpts:
        ckpts.save(state(3), 3, blocking=True)
    (tmp_path / "step-000000000003" / "notes.txt").write_text("mine")
    check = ckptstream.check_step(tmp_path / "step-000000000003")
    assert check.complete
    assert check.problem is None
    assert (check.step, check.world_size, check.own, check.foreign) == (3, 1, ("DONE", "state.safetensors"),
                                                                         ("notes.txt",))
    size = (tmp_path / "step-000000000003" / "state.safetensors").stat().st_size
    assert dict(check.files) == {"state.safetensors": size}
    other = tmp_path / "best"  # a copy under another name: checked, but no step of the manager's
    other.mkdir()
    for name in ("DONE", "state.safetensors"):
        (other / name).write_bytes((tmp_path / "step-000000000003" / name).read_bytes())
    assert (ckptstream.check_step(other).step, ckptstream.check_step(other).complete) == (None, True)
    a_file = tmp_path / "step-000000000004"
    a_file.write_text("a file")
    assert ckptstream.check_step(a_file).problem == f"{a_file} is not a folder"
    missing = ckptstream.check_step(tmp_path / "missing").problem
    assert missing is not None
    assert missing.startswith(f"{tmp_path / 'missing'} cannot be read")
    assert [c.step for c in ckptstream.check_steps(tmp_path)] == [3]


@pytest.mark.parametrize("marker", ["DONE", "READY-rank-00001"])
def test_a_link_planted_as_a_marker_is_replaced_never_followed(marker: str, tmp_path: Path) -> None:
    """A link named as a marker, to a file outside, lies in the folder of the next step once the
    managers have cleaned up (their first save): saving that step publishes the marker in the
    folder, and the file outside keeps its bytes."""
    s = Setting(tmp_path)
    secret = s.secret.read_bytes()
    # two ranks in one process: the saves in flight are counted process-wide, hence max_in_flight=2
    world = 1 if marker == "DONE" else 2
    ranks = [ckptstream.CheckpointManager(s.directory, keep=None, max_in_flight=2, rank=r, world_size=world)
             for r in range(world)]
    try:
        for handle in [m.save(state(HOSTILE), HOSTILE) for m in ranks]:
            handle.result()
        folder = s.directory / f"step-{HOSTILE + 1:012d}"
        folder.mkdir()
        link = folder / marker
        link.symlink_to(s.secret)
        handles = [ranks[-1].save(state(HOSTILE + 1), HOSTILE + 1)]
        if marker != "DONE":  # rank 0 starts once rank 1 has published its READY (over the link, or through it)
            while link.is_symlink() and s.secret.read_bytes() == secret:
                time.sleep(0.005)
            handles.append(ranks[0].save(state(HOSTILE + 1), HOSTILE + 1))
        for handle in handles:
            handle.result()
        assert [m.latest_step() for m in ranks] == [HOSTILE + 1] * len(ranks)
    finally:
        for m in ranks:
            m.close()
    assert s.secret.read_bytes() == secret
    assert not link.is_symlink()


@pytest.mark.parametrize("what", ["file", "link to a folder"])
def test_what_lies_in_the_way_of_a_step_folder_is_refused(what: str, tmp_path: Path) -> None:
    s = Setting(tmp_path)
    in_the_way = s.directory / "step-000000000007"
    if what == "file":
        in_the_way.write_text("mine")
    else:
        in_the_way.symlink_to(s.outside)
    with ckptstream.CheckpointManager(s.directory, keep=None) as ckpts:
        with pytest.raises(FileExistsError, match="is in the way of the step's folder"):
            ckpts.save(state(7), 7)
        assert ckpts.steps() == [1]
    assert sorted(os.listdir(s.outside)) == ["secret"]
    assert in_the_way.is_symlink() or in_the_way.read_text() == "mine"
