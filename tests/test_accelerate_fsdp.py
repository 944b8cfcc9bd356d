"""StreamState under FSDP2: Accelerate's own save_state / load_state, its DCP model and optimizer
folders written and read by ckptstream.dcp.

Accelerate runs FSDP only on GPUs (with ``cpu=True``, or MULTI_CPU, it ignores the plugin), so
here one CPU process runs Accelerate's FSDP2 branch of ``save_state`` / ``load_state`` on a
plain module (the accelerator's type set to FSDP after ``prepare``): DCP's state-dict functions
that Accelerate calls take a plain module as they take an FSDP2 one. A real FSDP2 run is in
tests/test_accelerate_fsdp_gpu.py (``gpu``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dist_cp
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import ckptstream
from ckptstream import UnsupportedTypeError
from ckptstream.accelerate import StreamState

# one process without a process group: DCP says it saves as one
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def fsdp2_run(state_dict_type: str = "SHARDED_STATE_DICT", version: int = 2) -> dict[str, Any]:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type)
    return {"acc": as_fsdp(acc, plugin), "model": model, "opt": opt, "sched": sched, "plugin": plugin}


def as_fsdp(acc: Accelerator, plugin: FullyShardedDataParallelPlugin) -> Accelerator:
    """The accelerator's type FSDP (Accelerate's state sets it back at times: before each call)."""
    acc.state.fsdp_plugin, acc.state.distributed_type = plugin, DistributedType.FSDP
    return acc


def train(run: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        run["acc"].backward(run["model"](torch.randn(4, 6)).square().mean())
        run["opt"].step()
        run["sched"].step()
        run["opt"].zero_grad()


def copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy(v) for v in value]
    return value


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_fsdp2_model_and_optimizer_go_through_ckptstream_dcp(tmp_path: Path) -> None:
    run = fsdp2_run()
    acc = run["acc"]
    train(run, 3)
    as_fsdp(acc, run["plugin"])
    saved = {"model": copy(run["model"].state_dict()), "opt": copy(run["opt"].state_dict()),
             "sched": copy(run["sched"].state_dict())}
    with StreamState(acc):
        as_fsdp(acc, run["plugin"]).save_state(tmp_path / "ckpt")
        train(run, 2)
        assert not torch.equal(run["model"].state_dict()["0.weight"], saved["model"]["0.weight"])
        as_fsdp(acc, run["plugin"]).load_state(tmp_path / "ckpt")
    assert_same(run["model"].state_dict(), saved["model"], "model")
    assert_same(run["opt"].state_dict(), saved["opt"], "optimizer")
    assert_same(run["sched"].state_dict(), saved["sched"], "scheduler")
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # Accelerate's folders, ckptstream's files
        assert sorted(os.listdir(tmp_path / "ckpt" / folder)) == [".metadata", "rank-00000.safetensors"]
        ckptstream.verify(tmp_path / "ckpt" / folder / "rank-00000.safetensors")
    weights = ckptstream.load(tmp_path / "ckpt" / "pytorch_model_fsdp_0" / "rank-00000.safetensors")
    assert any(torch.equal(t, saved["model"]["0.weight"]) for t in _tensors(weights))
    # the names are Accelerate's again after each call, and after close()
    assert dist_cp.FileSystemWriter.__module__.startswith("torch.distributed.checkpoint")
    assert dist_cp.FileSystemReader.__module__.startswith("torch.distributed.checkpoint")
    assert "save_state" not in vars(acc)


def test_fsdp2_takes_no_background_mode_and_fsdp1_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dcp\.save before save_state returns"):
        StreamState(fsdp2_run()["acc"], mode="device")
    AcceleratorState._reset_state(True)
    with pytest.raises(UnsupportedTypeError, match="only FSDP2 with state_dict_type SHARDED_STATE_DICT"):
        StreamState(fsdp2_run(state_dict_type="FULL_STATE_DICT")["acc"])


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []
