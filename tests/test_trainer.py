"""StreamTrainer in this process: what its checkpoint folders hold, the order of its waits
(before rotation, resume and the end of train()), the errors of a failed background save, and
the refusals of folders a user hands it (the Trainer's own, one missing a file, an optimizer
whose param groups changed): typed errors naming the file and key, nothing overwritten; the
folders a killed save leaves, passed over by resume_from_checkpoint=True (which starts over
where there is no other)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import ckptstream
from ckptstream.errors import IncompleteCheckpointError, StateMismatchError, TrainerFolderError
from ckptstream.transformers import StreamTrainer, _trainer, state_file

from .trainerutil import tiny_trainer


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def digests(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_a_folder_holds_what_the_trainers_own_saver_holds(tmp_path: Path) -> None:
    mine = tiny_trainer(tmp_path / "mine", steps=4, save_every=4)
    mine.train()
    theirs = tiny_trainer(tmp_path / "theirs", steps=4, save_every=4, cls=Trainer)
    theirs.train()
    folder = tmp_path / "mine" / "checkpoint-4"
    assert sorted(f.name for f in folder.iterdir()) == ["ckptstream_state_0.safetensors", "config.json",
                                                       "trainer_state.json"]
    saved = ckptstream.load(state_file(folder, 0))
    ckptstream.verify(state_file(folder, 0))
    reference = tmp_path / "theirs" / "checkpoint-4"
    weights = ckptstream.load(reference / "model.safetensors")
    for key, tensor in weights.items():
        assert torch.equal(saved["model"][key], tensor), key
    optimizer = torch.load(reference / "optimizer.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"] == optimizer["param_groups"]
    for index, moments in optimizer["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(saved["optimizer"]["state"][index][name], tensor), (index, name)
    assert saved["scheduler"] == torch.load(reference / "scheduler.pt", weights_only=True)
    rng = torch.load(reference / "rng_state.pth", weights_only=False)
    assert torch.equal(saved["rng"]["torch"], rng["cpu"])
    assert (folder / "trainer_state.json").read_text() == (reference / "trainer_state.json").read_text()


def test_export_hf_makes_a_checkpoint_a_folder_from_pretrained_loads(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    trainer = tiny_trainer(tmp_path / "run", steps=3, save_every=3)
    trainer.train()
    folder = tmp_path / "run" / "checkpoint-3"
    ckptstream.export_hf(str(state_file(folder, 0)), str(tmp_path / "hf"), prefix="model.",
                         config=str(folder / "config.json"))
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for key, tensor in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


class Recorder:
    """save_async and the Trainer's rotation, recording when each save is waited for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: str | None = None) -> None:
        self.events: list[str] = []
        real_save, real_rotate = ckptstream.save_async, _trainer.StreamCheckpointsMixin._rotate

        def save_async(state: Any, path: Any, **kwargs: Any) -> Any:
            handle, name = real_save(state, path, **kwargs), Path(path).parent.name
            self.events.append(f"start {name}")
            recorder = self

            class Handle:
                def result(self) -> Any:
                    done = handle.result()
                    recorder.events.append(f"durable {name}")
                    if name == fail_at:
                        raise OSError(f"{path}: no space left on device")
                    return done

            return Handle()

        def rotate(trainer: Any, run_dir: str) -> None:
            self.events.append("rotate")
            real_rotate(trainer, run_dir)

        monkeypatch.setattr(_trainer, "save_async", save_async)
        monkeypatch.setattr(_trainer.StreamCheckpointsMixin, "_rotate", rotate)


def test_saves_are_durable_before_rotation_resume_and_the_end_of_train(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(monkeypatch)
    tiny_trainer(tmp_path / "run", steps=6, save_every=2).train()
    assert recorder.events == ["start checkpoint-2", "durable checkpoint-2", "rotate", "start checkpoint-4",
                               "durable checkpoint-4", "rotate", "start checkpoint-6", "durable checkpoint-6",
                               "rotate"]
    assert sorted(f.name for f in (tmp_path / "run").iterdir()) == ["checkpoint-4", "checkpoint-6"]
    recorder.events.clear()
    trainer = tiny_trainer(tmp_path / "run", steps=8, save_every=2)
    trainer.train(resume_from_checkpoint=True)
    assert recorder.events == ["start checkpoint-8", "durable checkpoint-8", "rotate"]
    assert trainer.state.global_step == 8


@pytest.mark.parametrize("fail_at", ["checkpoint-2", "checkpoint-4"])
def test_a_failed_background_save_raises_from_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    fail_at: str) -> None:
    Recorder(monkeypatch, fail_at=fail_at)
    trainer = tiny_trainer(tmp_path / "run", steps=4, save_every=2)
    with pytest.raises(OSError, match="no space left on device"):
        trainer.train()  # checkpoint-2: at the next save; checkpoint-4: at the end of train()


def test_a_folder_of_the_trainers_own_saver_is_refused_with_its_files(tmp_path: Path) -> None:
    tiny_trainer(tmp_path / "run", steps=2, save_every=2, cls=Trainer).train()
    before = digests(tmp_path / "run")
    for resume in (True, str(tmp_path / "run" / "checkpoint-2")):
        trainer = tiny_trainer(tmp_path / "run", steps=4, save_every=2)
        with pytest.raises(TrainerFolderError, match=r"checkpoint-2 was written by the Trainer's own saver \(.*"
                           r"model\.safetensors, optimizer\.pt, rng_state\.pth, scheduler\.pt.*"
                           r"load_default_checkpoints=True") as caught:
            trainer.train(resume_from_checkpoint=resume)
        assert "optimizer.pt" in caught.value.files
        assert digests(tmp_path / "run") == before  # nothing written, nothing removed
    # continuing: the Trainer's own loader reads it once, the next checkpoints are ckptstream's
    trainer = tiny_trainer(tmp_path / "run", steps=4, save_every=2, load_default_checkpoints=True)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 4
    assert state_file(tmp_path / "run" / "checkpoint-4", 0).is_file()


@pytest.mark.parametrize("missing", ["ckptstream_state_0.safetensors", "trainer_state.json"])
def test_a_folder_missing_a_file_is_refused_by_name_and_passed_over(tmp_path: Path, missing: str) -> None:
    tiny_trainer(tmp_path / "run", steps=4, save_every=2).train()
    (tmp_path / "run" / "checkpoint-4" / missing).unlink()
    before = digests(tmp_path / "run")
    trainer = tiny_trainer(tmp_path / "run", steps=6, save_every=2)
    with pytest.raises(IncompleteCheckpointError, match=rf"checkpoint-4: the checkpoint is incomplete, {missing} "
                       "missing"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert digests(tmp_path / "run") == before
    trainer = tiny_trainer(tmp_path / "run", steps=6, save_every=2)
    trainer.train(resume_from_checkpoint=True)  # the newest complete folder: checkpoint-2
    assert trainer.state.global_step == 6


class Steps(TrainerCallback):
    """The steps a run trains."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(state.global_step)


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in trainer.model.state_dict().items()}


def assert_same(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(mine) == list(theirs)
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def leave_as_killed_before_publishing(folder: Path) -> None:
    """Make ``folder`` what a save killed just before its publishing rename leaves: its state file
    back under the temp name it was written as, the temp of a writer that is gone."""
    target = state_file(folder, 0)
    script = "import sys; from ckptstream._storage.publish import temp_path_for; print(temp_path_for(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    temp = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()
    os.rename(target, temp)


def ckptstream_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("ckptstream") and r.levelno >= logging.WARNING]


def test_a_newer_folder_a_killed_save_left_is_passed_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Killed just before checkpoint-6 published: the Trainer's own pick (the newest folder) is
    that one; resume_from_checkpoint=True resumes from checkpoint-4 instead, runs steps 5 and 6
    again, and ends where the uninterrupted run ended, checkpoint-6 written anew."""
    run = tmp_path / "run"
    whole = tiny_trainer(run, steps=6, save_every=2)
    whole.train()
    reference, saved = weights(whole), ckptstream.load(state_file(run / "checkpoint-6", 0))
    leave_as_killed_before_publishing(run / "checkpoint-6")
    [temp] = [name for name in os.listdir(run / "checkpoint-6") if name.startswith(".")]
    assert temp.startswith(".ckptstream_state_0.safetensors.ckptstream-tmp-")
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-6")
    steps = Steps()
    trainer = tiny_trainer(run, steps=6, save_every=2, callbacks=[steps])
    with caplog.at_level(logging.WARNING, logger="ckptstream"):
        trainer.train(resume_from_checkpoint=True)
    assert steps.steps == [5, 6]
    assert ckptstream_warnings(caplog) == []
    assert_same(weights(trainer), reference)
    assert sorted(os.listdir(run / "checkpoint-6")) == ["ckptstream_state_0.safetensors", "config.json",
                                                       "trainer_state.json"]  # the dead writer's temp removed
    assert_same(ckptstream.load(state_file(run / "checkpoint-6", 0))["model"], saved["model"])


def test_a_run_killed_in_its_first_save_starts_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Killed just before its first save published: no folder holds a state file, and
    resume_from_checkpoint=True starts over with a warning, to the uninterrupted run's weights."""
    run = tmp_path / "run"
    whole = tiny_trainer(run, steps=4, save_every=2)
    whole.train()
    reference = weights(whole)
    (run / "checkpoint-4").rename(tmp_path / "checkpoint-4")  # a run killed in the save of checkpoint-2
    leave_as_killed_before_publishing(run / "checkpoint-2")
    steps = Steps()
    trainer = tiny_trainer(run, steps=4, save_every=2, callbacks=[steps])
    with caplog.at_level(logging.WARNING, logger="ckptstream"):
        trainer.train(resume_from_checkpoint=True)
    assert steps.steps == [1, 2, 3, 4]
    assert ckptstream_warnings(caplog) == [
        f"{run}: no checkpoint to resume from, the folders there (checkpoint-2) hold no ckptstream state file, only "
        "what saves killed before publishing one left: training starts over from step 0"]
    assert_same(weights(trainer), reference)
    assert sorted(f.name for f in run.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert state_file(run / "checkpoint-2", 0).is_file()


def test_a_kills_leftover_beside_other_folders_is_no_fresh_start(tmp_path: Path) -> None:
    """A newer leftover does not hide a folder of the Trainer's own saver (refused, or with
    load_default_checkpoints resumed from), nor a folder that lost a file (refused by name)."""
    run = tmp_path / "run"
    tiny_trainer(run, steps=2, save_every=2, cls=Trainer).train()
    (run / "checkpoint-4").mkdir()
    (run / "checkpoint-4" / "trainer_state.json").write_text("{}")  # what a save killed before publishing left
    before = digests(run)
    with pytest.raises(TrainerFolderError, match=r"checkpoint-2 was written by the Trainer's own saver"):
        tiny_trainer(run, steps=4, save_every=2).train(resume_from_checkpoint=True)
    assert digests(run) == before
    steps = Steps()
    tiny_trainer(run, steps=4, save_every=2, load_default_checkpoints=True, callbacks=[steps]).train(
        resume_from_checkpoint=True)
    assert steps.steps == [3, 4]  # from checkpoint-2, through the Trainer's own loader
    other = tmp_path / "other"
    tiny_trainer(other, steps=2, save_every=2).train()
    (other / "checkpoint-2" / "trainer_state.json").unlink()  # a file lost: not what a kill leaves
    (other / "checkpoint-4").mkdir()
    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint-2: the checkpoint is incomplete, "
                       r"trainer_state\.json missing, and no checkpoint-<step> folder of .*other is complete .*"
                       r"remove .*other/checkpoint-2 to start over"):
        tiny_trainer(other, steps=4, save_every=2).train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory"):
        tiny_trainer(tmp_path / "none", steps=2, save_every=2).train(resume_from_checkpoint=True)


def test_an_optimizer_whose_param_groups_changed_is_refused_by_key(tmp_path: Path) -> None:
    tiny_trainer(tmp_path / "run", steps=2, save_every=2).train()
    before = digests(tmp_path / "run")
    trainer = tiny_trainer(tmp_path / "run", steps=4, save_every=2, optimizers="two groups")
    with pytest.raises(StateMismatchError, match=r"checkpoint-2/ckptstream_state_0\.safetensors: \['optimizer'\]"
                       r"\['param_groups'\]\[0\]\['params'\]: the checkpoint's group holds 10 parameters, the "
                       "optimizer's 3"):
        trainer.train(resume_from_checkpoint=True)
    assert digests(tmp_path / "run") == before  # no step ran, no checkpoint was written


def test_a_mode_it_does_not_take_and_load_best_model_at_end_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_mode must be None"):
        tiny_trainer(tmp_path / "run", steps=2, save_every=2, checkpoint_mode="eager")
    best = {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 2}
    with pytest.raises(ValueError, match="load_best_model_at_end reads the Trainer's own model files"):
        tiny_trainer(tmp_path / "run", steps=2, save_every=2, training=best, eval_dataset=[])
    assert issubclass(StreamTrainer, Trainer)


def test_a_folder_missing_a_rank_is_incomplete_by_name(tmp_path: Path) -> None:
    from ckptstream.transformers import _folders

    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
        ckptstream.save({"rng": torch.zeros(2)}, state_file(folder, 0))
    ckptstream.save({"rng": torch.zeros(2)}, state_file(tmp_path / "checkpoint-2", 1))
    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint-4: the checkpoint is incomplete, "
                       r"ckptstream_state_1\.safetensors missing"):
        _folders.check_folder(str(tmp_path / "checkpoint-4"), world_size=2)
    assert _folders.newest_complete(str(tmp_path), world_size=2) == str(tmp_path / "checkpoint-2")
    assert _folders.newest_complete(str(tmp_path), world_size=1) == str(tmp_path / "checkpoint-4")


@pytest.mark.parametrize("mode", ["lazy", "host", "device"])
def test_each_mode_saves_the_state_of_its_step(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstream._storage.files import FileSink

    # an embedding of 1.2 MiB: "lazy" streams it from the live tensor (smaller CPU tensors are copied at the call)
    tiny_trainer(tmp_path / "sync", steps=4, save_every=2, checkpoint_mode=None, vocab=10_000).train()
    real_write = FileSink.write_at

    def slow_write(sink: Any, view: memoryview, offset: int) -> None:
        time.sleep(0.5)  # a slow disk: the next steps run while the background save still reads
        real_write(sink, view, offset)

    monkeypatch.setattr(FileSink, "write_at", slow_write)
    tiny_trainer(tmp_path / mode, steps=4, save_every=2, checkpoint_mode=mode, vocab=10_000).train()
    monkeypatch.undo()
    for step in (2, 4):
        theirs = ckptstream.load(state_file(tmp_path / "sync" / f"checkpoint-{step}", 0))
        mine = ckptstream.load(state_file(tmp_path / mode / f"checkpoint-{step}", 0))
        for key, tensor in theirs["model"].items():
            assert torch.equal(mine["model"][key], tensor), (step, key)
        for index, moments in theirs["optimizer"]["state"].items():
            for name, tensor in moments.items():
                assert torch.equal(mine["optimizer"]["state"][index][name], tensor), (step, index, name)
