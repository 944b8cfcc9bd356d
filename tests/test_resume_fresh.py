"""Resuming a freshly built optimizer: ``load_into`` creates the file's tensors that the state
lacks below its empty containers (a fresh optimizer's ``"state": {}``), on the device of the
state's tensors, 0-d step counters on the CPU; in a fresh process, the README's call continues
the run bit for bit."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import ckptstream
from ckptstream._checkpoint import load_into
from tests.helpers import random_tensor
from tests.resume.trainutil import differences, run_child


def trained(device: str = "cpu", seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def one_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g).to(next(model.parameters()).device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("strict", [True, False])
def test_a_fresh_optimizer_gets_its_moments(strict: bool, tmp_path: Path) -> None:
    model, opt = trained()
    for i in range(2):
        one_step(model, opt, i)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}, path)
    fresh, fresh_opt = trained(seed=1)
    target: dict[str, Any] = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    assert target["optim"]["state"] == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = ckptstream.load_into(target, path, strict=strict)
    assert loaded["model"]["0.weight"] is target["model"]["0.weight"]  # the model's own tensors, filled
    created = loaded["optim"]["state"]
    assert sorted(created) == [0, 1, 2, 3]
    assert created[0]["step"].shape == ()
    assert differences(loaded["optim"], opt.state_dict()) == []
    fresh_opt.load_state_dict(loaded["optim"])
    one_step(model, opt, 2)
    one_step(fresh, fresh_opt, 2)
    assert differences(fresh.state_dict(), model.state_dict()) == []
    assert differences(fresh_opt.state_dict(), opt.state_dict()) == []


def test_without_device_nothing_is_created(tmp_path: Path) -> None:
    model, opt = trained()
    one_step(model, opt, 0)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    fresh, fresh_opt = trained(seed=1)
    missing = r"in the file but not in the state: optim\.state\.0\.exp_avg"
    with pytest.raises(ckptstream.StateMismatchError, match=missing):
        ckptstream.load_into({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}, path, device=None)
    with pytest.warns(ckptstream.StateMismatchWarning, match="skipped 0 missing key"):
        loaded = ckptstream.load_into({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}, path,
                                      strict=False, device=None)
    assert loaded["optim"]["state"][0]["exp_avg"] is None


def test_only_below_empty_containers(tmp_path: Path) -> None:
    base = random_tensor(40)
    shared = random_tensor(6)
    state = {"model": {"w": random_tensor(3), "extra": random_tensor(2)},
             "rng": {"cpu": random_tensor(5, torch.uint8), "list": [random_tensor(2, torch.int64)]},
             "opt": {"a": shared, "b": shared, "whole": base, "part": base[10:20], "n": torch.tensor(4)},
             "top": random_tensor(4)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    target: dict[str, Any] = {"model": {"w": torch.empty(3)}, "rng": {}, "opt": {}}
    with pytest.raises(ckptstream.StateMismatchError) as e:  # model.extra: below a container that is not empty
        ckptstream.load_into(target, path)
    assert "model.extra" in str(e.value)
    assert "top" in str(e.value)
    assert "rng" not in str(e.value)
    with pytest.warns(ckptstream.StateMismatchWarning) as record:
        loaded = ckptstream.load_into(target, path, strict=False)
    assert isinstance(record[0].message, ckptstream.StateMismatchWarning)
    assert record[0].message.unexpected == ["model.extra", "top"]
    assert loaded["model"]["extra"] is None
    assert loaded["top"] is None
    assert loaded["model"]["w"] is target["model"]["w"]
    assert differences({"rng": loaded["rng"], "opt": loaded["opt"]}, {"rng": state["rng"], "opt": state["opt"]}) == []
    assert loaded["opt"]["a"] is loaded["opt"]["b"]  # stored once: created once
    assert target["rng"] == {}
    assert target["opt"] == {}


def test_several_gpus_need_a_device(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"opt": {"m": random_tensor(4)}}, path)
    on_two_gpus: Any = {("a",): SimpleNamespace(device=torch.device("cuda", 0)),
                        ("b",): SimpleNamespace(device=torch.device("cuda", 1))}
    with ckptstream.open(path) as reader, pytest.raises(ckptstream.StateMismatchError, match="pass device="):
        load_into._created(reader, {"opt": {}}, on_two_gpus, "auto")


def test_the_readme_resume_in_a_fresh_process(tmp_path: Path) -> None:
    run_child("child_fresh_optimizer.py", "save", str(tmp_path), "cpu", "64")
    report = json.loads(run_child("child_fresh_optimizer.py", "resume", str(tmp_path), "cpu", "64").stdout)
    assert report["same"] is True
    assert (report["exp_avg_device"], report["step_device"]) == ("cpu", "cpu")


@pytest.mark.gpu
def test_gpu_resume_creates_the_moments_on_the_gpu_without_a_host_copy(tmp_path: Path) -> None:
    run_child("child_fresh_optimizer.py", "save", str(tmp_path), "cuda", "8192")  # 2 x 256 MiB of moments
    report = json.loads(run_child("child_fresh_optimizer.py", "resume", str(tmp_path), "cuda", "8192").stdout)
    assert report["same"] is True
    assert (report["exp_avg_device"], report["step_device"]) == ("cuda:0", "cpu")
    assert report["moment_bytes"] >= 512 << 20
    # the staging buffers, not a host copy of the state
    assert report["rss_growth"] <= report["staging_bytes"] + (96 << 20), report
    assert report["rss_growth"] < report["moment_bytes"] // 2, report


@pytest.mark.gpu
def test_gpu_explicit_device_and_auto(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"w": random_tensor(4), "opt": {"m": random_tensor(3), "step": torch.tensor(2.0)}}, path)
    loaded = ckptstream.load_into({"w": torch.empty(4, device="cuda"), "opt": {}}, path)
    assert loaded["opt"]["m"].is_cuda
    assert loaded["opt"]["step"].device.type == "cpu"
    loaded = ckptstream.load_into({"w": torch.empty(4), "opt": {}}, path, device="cuda")
    assert loaded["opt"]["m"].is_cuda
    assert loaded["opt"]["step"].device.type == "cpu"
