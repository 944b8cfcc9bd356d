"""StreamCheckpointIO in real Trainer runs on the CPU: a resume through ckptstream files gives the
losses of the same resume through Lightning's own checkpoint IO, bit for bit, in every mode; the
files hold the same values as Lightning's; save_top_k never removes a file still being written;
a "lazy" save is read out before the next update changes the weights."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream.lightning import StreamCheckpointIO
from tests.lightningutil import LIGHTNING_WARNINGS, AtBatchEnd, assert_same, bits, files, fit, held_saves

pytestmark = [*LIGHTNING_WARNINGS, pytest.mark.filterwarnings("ignore:.*The dirpath has changed.*")]

MODES = [None, "device", "lazy"]  # "host": tests/test_lightning_io.py (the same path as "device" here)


@dataclasses.dataclass
class Reference:
    """A run through Lightning's default checkpoint IO: 2 epochs, a checkpoint by ModelCheckpoint
    every 3 steps (the newest 2 kept) and one at the end, then a resume from it to 4 epochs."""

    dir: Path
    first: list[int]
    resumed: list[int]


def run_and_resume(dirpath: Path, io: StreamCheckpointIO | None) -> tuple[list[int], list[int]]:
    model, run = fit(dirpath / "ckpts", io, epochs=2)
    run.save_checkpoint(dirpath / "end.ckpt")  # after fit: the run stopped at an epoch boundary
    resumed, _ = fit(dirpath / "resumed", io, epochs=4, ckpt_path=str(dirpath / "end.ckpt"))
    if io is not None:
        io.teardown()
    return bits(model.losses), bits(resumed.losses)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    d = tmp_path_factory.mktemp("default-io")
    first, resumed = run_and_resume(d, None)
    return Reference(d, first, resumed)


def checkpoint_files(d: Path) -> list[str]:
    return [f"ckpts/{n}" for n in files(d / "ckpts")] + [f"resumed/{n}" for n in files(d / "resumed")] + ["end.ckpt"]


def assert_same_files(ours: Path, reference: Reference) -> None:
    """Every file of ``ours`` is a valid ckptstream file holding what Lightning's file holds."""
    assert checkpoint_files(ours) == checkpoint_files(reference.dir)
    assert len(checkpoint_files(ours)) == 5  # 2 + 2 kept by save_top_k, and the end's

    def same_text(text: str) -> str:
        return text.replace(str(ours), "<dir>").replace(str(reference.dir), "<dir>")

    loader = StreamCheckpointIO()
    for name in checkpoint_files(ours):
        ckptstream.verify(ours / name)
        theirs = torch.load(reference.dir / name, map_location="cpu", weights_only=False)
        assert_same(loader.load_checkpoint(ours / name), theirs, name, same_text=same_text)


@pytest.mark.parametrize("mode", MODES, ids=[str(m) for m in MODES])
def test_resume_is_bit_equal_to_lightnings_own(mode: str | None, reference: Reference, tmp_path: Path) -> None:
    first, resumed = run_and_resume(tmp_path, StreamCheckpointIO(mode))
    assert len(first) == 12
    assert len(resumed) == 12
    assert first == reference.first  # the saves changed nothing in the run
    assert resumed == reference.resumed
    assert_same_files(tmp_path, reference)


def step_of(path: str) -> int:
    found = re.search(r"step=(\d+)", path)
    assert found is not None, path
    return int(found.group(1))


def test_save_top_k_never_removes_a_file_still_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each save is held before it writes a byte until the plug-in waits for it, or else two
    # batches later; save_top_k=1 removes the previous checkpoint right after starting the next
    # one, while the previous one is still held: a removal that does not wait for it removes
    # nothing, and the file appears afterwards.
    io = StreamCheckpointIO("device", max_in_flight=2)
    with held_saves(monkeypatch) as holds:
        def release_two_steps_back(step: int) -> None:
            for path in list(holds._events):
                if step_of(path) <= step - 2:
                    holds.release(path, "two steps later")

        fit(tmp_path / "ckpts", io, epochs=2, every=1, top_k=1, monitor=None,
            callbacks=[AtBatchEnd(release_two_steps_back)])
        io.teardown()
    assert files(tmp_path / "ckpts") == ["epoch=1-step=12.ckpt"]
    ckptstream.verify(tmp_path / "ckpts" / "epoch=1-step=12.ckpt")
    # every save was released by a wait for its result: the removal of the save before
    assert holds.released() == [("result", f"epoch={(s - 1) // 6}-step={s}.ckpt") for s in range(1, 13)]
    assert [step_of(name) for name in holds.published()] == list(range(1, 13))


def test_lazy_saves_are_read_out_before_the_next_update(reference: Reference, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # "lazy" streams the first layer's weights and moments (over 1 MiB) from the live tensors.
    # Each save is held until the plug-in waits for it to be staged, or else until the next
    # batch ends (after that batch's update): a save that the update did not wait for holds the
    # next step's weights under this step's name.
    io = StreamCheckpointIO("lazy")
    with held_saves(monkeypatch) as holds:
        release_at_batch_end = AtBatchEnd(lambda step: holds.release_all("the next batch end"))
        model, _run = fit(tmp_path / "ckpts", io, epochs=2, callbacks=[release_at_batch_end])
        io.teardown()
    assert bits(model.losses) == reference.first
    loader = StreamCheckpointIO()
    for name in files(tmp_path / "ckpts"):
        theirs = torch.load(reference.dir / "ckpts" / name, map_location="cpu", weights_only=False)
        ours: dict[str, Any] = loader.load_checkpoint(tmp_path / "ckpts" / name)
        assert_same(ours["state_dict"], theirs["state_dict"], name)
        assert_same(ours["optimizer_states"], theirs["optimizer_states"], name)
    # each save was released by a wait for it to be staged: the next update's, or teardown's
    assert holds.released() == [("wait_staged", f"epoch={(s - 1) // 6}-step={s}.ckpt") for s in (3, 6, 9, 12)]
