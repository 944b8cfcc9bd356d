"""ckptstream.accelerate.StreamState without a subprocess: what ``save_state`` saves comes back
exactly (compared with what Accelerate's own saver writes), automatic naming and total_limit, a
background save holds the state of its call, and bad input raises typed errors with nothing
overwritten."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

import ckptstream
from ckptstream import StateMismatchError
from ckptstream.accelerate import AccelerateFolderError, StreamState, state_file

MODES = [None, "device", "lazy", "host"]


class Counter:
    """A registered object with a tensor and plain values."""

    def __init__(self) -> None:
        self.seen, self.table = 0, torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "table": self.table.clone(), "name": "counter"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.table = state["seen"], state["table"]


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: each test starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def setup(project: Path | None = None, total_limit: int | None = None, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                  total_limit=total_limit) if project is not None else None
    acc = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    other = torch.nn.Linear(3, 2)
    groups: list[dict[str, Any]] = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.02}]
    opt = torch.optim.AdamW(groups, lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, other, opt, sched = acc.prepare(model, other, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return {"acc": acc, "model": model, "other": other, "opt": opt, "sched": sched, "counter": counter}


def train(run: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        loss = run["other"](run["model"](torch.randn(4, 6))).square().mean()
        run["acc"].backward(loss)
        run["opt"].step()
        run["sched"].step()
        run["opt"].zero_grad()
        run["counter"].seen += 1
        run["counter"].table += torch.randn(3)


def snapshot(run: dict[str, Any]) -> dict[str, Any]:
    """Everything save_state saves, copied (RNG states as the generators give them)."""
    return {"model": {k: v.clone() for k, v in run["model"].state_dict().items()},
            "other": {k: v.clone() for k, v in run["other"].state_dict().items()},
            "opt": _copy(run["opt"].state_dict()), "sched": _copy(run["sched"].state_dict()),
            "counter": _copy(run["counter"].state_dict()), "step": run["acc"].step,
            "random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Exact equality: tensors bit for bit (and dtype), containers and plain values alike."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
        assert a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b), where
        assert a == b, where


def changed(run: dict[str, Any], other: dict[str, Any]) -> bool:
    return not torch.equal(run["model"].state_dict()["0.weight"], other["model"]["0.weight"])


@pytest.mark.parametrize("mode", MODES)
def test_a_round_trip_restores_everything_save_state_saves(tmp_path: Path, mode: str | None) -> None:
    run = setup()
    train(run, 3)
    with StreamState(run["acc"], mode=mode) as stream:
        before = snapshot(run)
        folder = run["acc"].save_state(tmp_path / "ckpt")
        train(run, 2)  # the state moves on (a "lazy" save waits before the update)
        assert changed(run, before)
        stream.wait()
        assert folder == tmp_path / "ckpt"
        assert sorted(os.listdir(folder)) == ["ckptstream_state_0.safetensors"]
        ckptstream.verify(state_file(folder, 0))
        run["acc"].load_state(folder)
    assert_same(snapshot(run), before)
    # the accelerator has its own methods back
    assert "save_state" not in vars(run["acc"])
    assert "load_state" not in vars(run["acc"])


def test_the_file_holds_what_accelerates_own_saver_writes(tmp_path: Path) -> None:
    run = setup()
    train(run, 3)
    theirs = run["acc"].save_state(tmp_path / "default")  # Accelerate's own saver, the same moment
    with StreamState(run["acc"]):
        run["acc"].save_state(tmp_path / "stream")
    ours = ckptstream.load(state_file(tmp_path / "stream", 0))
    from safetensors.torch import load_file

    assert_same(ours["models"][0], dict(run["model"].state_dict()))
    second = load_file(theirs / "model_1.safetensors")  # safetensors sorts the names
    assert_same({k: ours["models"][1][k] for k in second}, second)
    first = load_file(theirs / "model.safetensors")
    assert_same({k: ours["models"][0][k] for k in first}, first)
    assert_same(ours["optimizers"][0], torch.load(theirs / "optimizer.bin", weights_only=True))
    assert_same(ours["schedulers"][0], torch.load(theirs / "scheduler.bin", weights_only=True))
    assert_same(ours["custom"][0], torch.load(theirs / "custom_checkpoint_0.pkl", weights_only=True))
    rng = torch.load(theirs / "random_states_0.pkl", weights_only=False)
    assert ours["rng"]["step"] == rng["step"]
    assert_same(ours["rng"]["torch"], rng["torch_manual_seed"])
    assert tuple(ours["rng"]["random"]["state"].tolist()) == rng["random_state"][1]
    assert np.array_equal(ours["rng"]["numpy"]["keys"].numpy(), rng["numpy_random_seed"][1])


def test_automatic_naming_and_total_limit_as_accelerate_documents(tmp_path: Path) -> None:
    run = setup(tmp_path / "project", total_limit=2)
    acc = run["acc"]
    checkpoints = tmp_path / "project" / "checkpoints"
    with StreamState(acc, mode="device") as stream:
        states = []
        for _ in range(4):
            train(run, 1)
            states.append(snapshot(run))
            assert acc.save_state() == checkpoints / f"checkpoint_{len(states) - 1}"
            assert sorted(os.listdir(checkpoints)) == [f"checkpoint_{i}" for i in range(max(0, len(states) - 2),
                                                                                        len(states))]
        assert acc.project_configuration.iteration == 4
        stream.wait()
        train(run, 2)
        acc.load_state()  # the newest folder
        assert_same(snapshot(run), states[3])
        acc.load_state(checkpoints / "checkpoint_2")
        assert_same(snapshot(run), states[2])
        acc.project_configuration.iteration = 3  # a folder that holds a checkpoint is not overwritten
        with pytest.raises(ValueError, match=r"checkpoint_3 .* already exists"):
            acc.save_state()
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_2", "checkpoint_3"]  # a refused save removes nothing
        # a folder a killed save left without its file: passed over by load_state(), reused by save_state()
        os.remove(state_file(checkpoints / "checkpoint_3", 0))
        acc.load_state()
        assert_same(snapshot(run), states[2])
        assert acc.save_state() == checkpoints / "checkpoint_3"


class Killed(Exception):
    """Stands for a SIGKILL before a save published its file."""


def killed_save(*args: Any, **kwargs: Any) -> None:
    raise Killed


def test_a_run_killed_twice_in_a_row_keeps_its_last_checkpoint(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """total_limit counts checkpoints, not the folders killed saves left: else the save after a
    resume removes the last checkpoint, and a kill before it publishes leaves none to resume."""
    run = setup(tmp_path / "project", total_limit=2)
    acc = run["acc"]
    checkpoints = tmp_path / "project" / "checkpoints"
    with StreamState(acc):
        for _ in range(3):
            train(run, 1)
            if acc.project_configuration.iteration == 1:
                last = snapshot(run)
            acc.save_state()
    os.remove(state_file(checkpoints / "checkpoint_2", 0))  # killed while it wrote checkpoint_2
    acc.project_configuration.iteration = 3  # the resumed run goes on after the newest folder
    with StreamState(acc):
        acc.load_state()
        assert_same(snapshot(run), last)
        train(run, 1)
        with monkeypatch.context() as patch:
            patch.setattr("ckptstream.accelerate._stream.save", killed_save)
            with pytest.raises(Killed):
                acc.save_state()  # killed again before checkpoint_3 published
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_3"]  # the leftover removed
        acc.load_state()  # the next resume
        assert_same(snapshot(run), last)
        assert acc.save_state() == checkpoints / "checkpoint_3"
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_3"]


def test_a_run_killed_in_its_first_save_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A save makes its folder before its file: a run killed in between, before any checkpoint
    was written, leaves a checkpoint folder without one. load_state() then loads nothing (the run
    starts over) and says so; a folder that holds a checkpoint file, even one of Accelerate's own
    saver, is still refused."""
    run = setup(tmp_path / "project", total_limit=2)
    acc = run["acc"]
    checkpoints = tmp_path / "project" / "checkpoints"
    with StreamState(acc):
        with pytest.raises(FileNotFoundError, match=r"checkpoints: no checkpoint folder to load"):
            acc.load_state()  # no folder at all: nothing says a run saved, as with Accelerate
        train(run, 1)
        with monkeypatch.context() as patch:
            patch.setattr("ckptstream.accelerate._stream.save", killed_save)
            with pytest.raises(Killed):
                acc.save_state()  # killed before checkpoint_0 published
        assert os.listdir(checkpoints) == ["checkpoint_0"]
        assert os.listdir(checkpoints / "checkpoint_0") == []
        before = snapshot(run)
        with caplog.at_level(logging.WARNING, logger="ckptstream"):
            acc.load_state()
        assert_same(snapshot(run), before)
        said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
        assert said == [("ckptstream.accelerate._stream", "WARNING",
                         f"{checkpoints}: no checkpoint to load, the folders there (checkpoint_0) hold no checkpoint "
                         "file, only what saves killed before publishing one left: the accelerator's state is left "
                         "as it is")]
        assert acc.save_state() == checkpoints / "checkpoint_0"  # the leftover written into
        train(run, 1)
        acc.load_state()
        assert_same(snapshot(run), before)
    assert acc.save_state() == checkpoints / "checkpoint_1"  # Accelerate's own saver, then a leftover
    os.remove(state_file(checkpoints / "checkpoint_0", 0))
    os.mkdir(checkpoints / "checkpoint_2")
    with StreamState(acc), pytest.raises(AccelerateFolderError, match=r"checkpoint_1 was written by Accelerate"):
        acc.load_state()


def test_total_limit_1_keeps_the_last_checkpoint_until_the_next_is_written(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = setup(tmp_path / "project", total_limit=1)
    acc = run["acc"]
    checkpoints = tmp_path / "project" / "checkpoints"
    with StreamState(acc):
        train(run, 1)
        acc.save_state()
        train(run, 1)
        last = snapshot(run)
        acc.save_state()
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1"]
        train(run, 1)
        with monkeypatch.context() as patch:
            patch.setattr("ckptstream.accelerate._stream.save", killed_save)
            with pytest.raises(Killed):
                acc.save_state()
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2"]
        acc.load_state()
        assert_same(snapshot(run), last)


@pytest.mark.parametrize("mode", ["device", "lazy", "host"])
def test_a_background_save_holds_the_state_of_its_call(tmp_path: Path, mode: str) -> None:
    run = setup()
    train(run, 2)
    with StreamState(run["acc"], mode=mode) as stream:
        at_call = snapshot(run)
        run["acc"].save_state(tmp_path / "a")
        train(run, 3)  # changes weights, moments, scheduler, counter and every generator
        later = snapshot(run)
        run["acc"].save_state(tmp_path / "b")
        stream.wait()
        train(run, 1)
        run["acc"].load_state(tmp_path / "a")
        assert_same(snapshot(run), at_call)
        run["acc"].load_state(tmp_path / "b")
        assert_same(snapshot(run), later)


def test_a_folder_of_accelerates_own_saver_is_named_with_its_files(tmp_path: Path) -> None:
    run = setup()
    train(run, 1)
    run["acc"].save_state(tmp_path / "default")
    with StreamState(run["acc"]), pytest.raises(AccelerateFolderError) as e:
        run["acc"].load_state(tmp_path / "default")
    assert e.value.files == ["custom_checkpoint_0.pkl", "model.safetensors", "model_1.safetensors", "optimizer.bin",
                             "random_states_0.pkl", "scheduler.bin"]
    assert "written by Accelerate's own save_state" in str(e.value)
    assert "load it once" in str(e.value)
    assert isinstance(e.value, ckptstream.NotACheckpointError)


def test_a_changed_optimizer_param_group_is_named_and_nothing_is_overwritten(tmp_path: Path) -> None:
    saved = setup()
    train(saved, 2)
    with StreamState(saved["acc"]):
        saved["acc"].save_state(tmp_path / "ckpt")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = setup(seed=5)
    run["opt"].add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})  # a third group
    train(run, 1)
    before = snapshot(run)
    with StreamState(run["acc"]), pytest.raises(StateMismatchError, match=r"optimizers\[0\]\['param_groups'\]: the "
                                                r"checkpoint holds 2 parameter groups, the optimizer 3"):
        run["acc"].load_state(tmp_path / "ckpt")
    assert_same(snapshot(run), before)  # weights, moments, generators: untouched


def test_a_group_with_other_parameters_is_named_by_its_key(tmp_path: Path) -> None:
    saved = setup()
    with StreamState(saved["acc"]):
        saved["acc"].save_state(tmp_path / "ckpt")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = setup(seed=5)
    run["opt"].param_groups[1]["params"].pop()  # the second group loses its bias
    before = snapshot(run)
    with StreamState(run["acc"]), pytest.raises(StateMismatchError, match=r"optimizers\[0\]\['param_groups'\]\[1\]"
                                                r"\['params'\]: the checkpoint's group holds 2 parameters, the "
                                                r"optimizer's 1"):
        run["acc"].load_state(tmp_path / "ckpt")
    assert_same(snapshot(run), before)


def test_a_model_of_another_shape_is_named_and_nothing_is_overwritten(tmp_path: Path) -> None:
    saved = setup()
    with StreamState(saved["acc"]):
        saved["acc"].save_state(tmp_path / "ckpt")
    state = ckptstream.load(state_file(tmp_path / "ckpt", 0))
    state["models"][1]["weight"] = torch.zeros(4, 3)
    ckptstream.save(state, state_file(tmp_path / "ckpt", 0))
    before = snapshot(saved)
    with StreamState(saved["acc"]), pytest.raises(StateMismatchError, match=r"models\[1\]\['weight'\]: .* shape "
                                                  r"\(4, 3\), the model's \(2, 3\)"):
        saved["acc"].load_state(tmp_path / "ckpt")
    assert_same(snapshot(saved), before)


def test_what_it_does_not_run_is_refused(tmp_path: Path) -> None:
    run = setup()
    with pytest.raises(ValueError, match="mode must be"):
        StreamState(run["acc"], mode="later")
    with StreamState(run["acc"]), pytest.raises(TypeError, match="DeepSpeed"):
        run["acc"].save_state(tmp_path / "x", tag="global_step1")


class Numbers(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class FakeLoader:
    """The two dataloader states Accelerate saves, without torchdata: a seedable sampler behind an
    ``IterableDatasetShard``, and a stateful dataloader's ``state_dict``."""

    def __init__(self) -> None:
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

        self.dataset = IterableDatasetShard(Numbers())
        self.sampler = SeedableRandomSampler(range(10), data_seed=7)
        self.use_stateful_dataloader = True
        self.position = {"batches": 0, "epoch": 0}

    def get_sampler(self) -> Any:
        return self.sampler

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = dict(state)


def test_sampler_and_stateful_dataloader_states_round_trip(tmp_path: Path) -> None:
    run = setup()
    loader = FakeLoader()
    run["acc"]._dataloaders.append(loader)
    loader.sampler.set_epoch(3)
    loader.position = {"batches": 5, "epoch": 3}
    with StreamState(run["acc"], mode="device"):
        run["acc"].save_state(tmp_path / "ckpt")
        loader.sampler.set_epoch(4)
        loader.sampler.initial_seed = 99
        loader.position = {"batches": 1, "epoch": 4}
        run["acc"].load_state(tmp_path / "ckpt")
    assert (loader.sampler.epoch, loader.sampler.initial_seed) == (3, 7)
    assert loader.position == {"batches": 5, "epoch": 3}


class Tags:
    def state_dict(self) -> dict[str, Any]:
        return {"tags": {"a", "b"}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("never loaded")


def test_a_registered_object_ckptstream_does_not_store_is_named_before_any_file(tmp_path: Path) -> None:
    run = setup()
    run["acc"].register_for_checkpointing(Tags())
    with StreamState(run["acc"], mode="device"), pytest.raises(ckptstream.UnsupportedTypeError,
                                                               match=r"custom.*1.*tags"):
        run["acc"].save_state(tmp_path / "ckpt")
    assert os.listdir(tmp_path / "ckpt") == []


def test_without_accelerates_backend_helper_the_generators_still_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerate before 1.16 has no ``get_torch_accelerator_backend``: the module's own
    stand-in names the same accelerator (none on a CPU machine), and the states round trip."""
    import importlib

    import accelerate.utils

    from ckptstream.accelerate import _state

    expected = ("cuda", torch.cuda) if torch.cuda.is_available() else (None, None)
    monkeypatch.delattr(accelerate.utils, "get_torch_accelerator_backend", raising=False)
    try:
        importlib.reload(_state)
        backend = getattr(_state, "get_torch_accelerator_backend")  # noqa: B009  (not exported)
        assert backend.__module__ == _state.__name__
        assert backend() == expected
        saved = _state.rng_state(3)
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        first = random.random(), [torch.rand(4, device=d) for d in devices]
        _state.set_rng_state(saved)
        again = random.random(), [torch.rand(4, device=d) for d in devices]
        assert first[0] == again[0]
        assert all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))
    finally:
        monkeypatch.undo()
        importlib.reload(_state)
