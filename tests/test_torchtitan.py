"""torchtitan's checkpoint module with ckptstream, in this process on a CPU: a
``StreamCheckpointManager`` over a tiny model and AdamW saves every few steps (synchronously and
through ``dcp.async_save`` in each staging mode) into torchtitan's ``step-N`` folders, and a
fresh manager over a fresh model resumes from the newest: the model, the optimizer, the
scheduler and the train state come back bit for bit. A folder saved by torchtitan's own
``CheckpointManager`` still loads; the pinned-memory async mode is refused with what to use."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan")


class Optimizer:
    """torchtitan's optimizer container, reduced to what the checkpointer uses (a Stateful)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return dict(get_optimizer_state_dict(self.model, self.opt))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, state)


class Scheduler:
    def __init__(self, opt: Optimizer) -> None:
        self.sched = torch.optim.lr_scheduler.StepLR(opt.opt, step_size=2, gamma=0.5)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sched.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sched.load_state_dict(state)


class TrainState:
    """The trainer's step (and, as a stand-in for torchtitan's stateful dataloader, its position)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


@pytest.fixture
def gloo(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def build(folder: Path, seed: int, stream: bool = True, device: str = "cpu",
          **options: Any) -> tuple[Any, nn.Module, Optimizer, Any]:
    from torchtitan.components.checkpoint import CheckpointManager

    from ckptstream.torchtitan import StreamCheckpointManager

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    opt = Optimizer(model)
    sched, train = Scheduler(opt), TrainState()
    kind = StreamCheckpointManager if stream else CheckpointManager
    config = kind.Config(enable=True, folder="checkpoint", interval=2, keep_latest_k=0, last_save_model_only=False,
                         **options)
    manager = config.build(dataloader=TrainState(), model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": train}, sd_adapter=None, base_folder=str(folder))
    return manager, model, opt, (sched, train)


def train(manager: Any, model: nn.Module, opt: Optimizer, rest: Any, steps: int) -> None:
    sched, state = rest
    data = torch.Generator().manual_seed(5)
    for step in range(1, steps + 1):
        x = torch.randn(4, 6, generator=data).to(next(model.parameters()).device)
        model(x).square().mean().backward()
        manager.maybe_wait_for_staging()  # where torchtitan's trainer waits: before the update
        opt.opt.step()
        opt.opt.zero_grad()
        sched.sched.step()
        state.step = step
        manager.save(step, last_step=step == steps)
    manager.maybe_wait_for_saving()


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            same(a[key], b[key])
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize(("async_mode", "stream_mode"), [("disabled", "device"), ("async", "device"),
                                                         ("async", "lazy"), ("async", "host")])
def test_resume_from_the_newest_step_bit_for_bit(gloo: Any, tmp_path: Path, async_mode: str,
                                                 stream_mode: str) -> None:
    resumes_bit_for_bit(tmp_path, "cpu", async_mode, stream_mode)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_mode", ["device", "host"])
def test_resume_from_the_newest_step_bit_for_bit_on_a_gpu(gloo: Any, tmp_path: Path, stream_mode: str) -> None:
    """The checkpoint module on a GPU (torchtitan 0.3.0's trainer does not import under torch
    2.11, see tests/test_torchtitan_gpu.py): device mode snapshots in GPU memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    resumes_bit_for_bit(tmp_path, "cuda", "async", stream_mode)


def resumes_bit_for_bit(tmp_path: Path, device: str, async_mode: str, stream_mode: str) -> None:
    import ckptstream.dcp

    manager, model, opt, rest = build(tmp_path, 0, device=device, async_mode=async_mode, stream_mode=stream_mode)
    train(manager, model, opt, rest, 5)
    manager.close()
    steps = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert steps == ["step-2", "step-4", "step-5"]
    for name in steps:  # ckptstream's files, with a CRC-32C per chunk
        files = ckptstream.dcp.checkpoint_files(tmp_path / "checkpoint" / name)
        assert [Path(f).name for f in files] == [".metadata", ckptstream.dcp.rank_file_name(0)]
    fresh, model2, opt2, (sched2, state2) = build(tmp_path, 1, device=device, async_mode=async_mode,
                                                  stream_mode=stream_mode)
    assert not torch.equal(model2.state_dict()["0.weight"], model.state_dict()["0.weight"])
    assert fresh.load()
    assert state2.step == 5
    same(model2.state_dict(), model.state_dict())
    same(opt2.state_dict(), opt.state_dict())
    assert sched2.sched.state_dict() == rest[0].sched.state_dict()
    fresh.close()


def test_a_step_folder_saved_by_torchtitans_own_saver_still_loads(gloo: Any, tmp_path: Path) -> None:
    manager, model, opt, rest = build(tmp_path, 0, stream=False)
    train(manager, model, opt, rest, 4)
    manager.close()
    assert any(p.suffix == ".distcp" for p in (tmp_path / "checkpoint" / "step-4").iterdir())
    fresh, model2, opt2, (_, state2) = build(tmp_path, 1)
    assert fresh.load()
    assert state2.step == 4
    same(model2.state_dict(), model.state_dict())
    same(opt2.state_dict(), opt.state_dict())
    fresh.close()


def test_a_kept_option_and_the_refused_pinned_mode() -> None:
    from torchtitan.components.checkpoint import CheckpointManager

    from ckptstream.torchtitan import StreamCheckpointManager, stream_checkpoints

    class Trainer:
        checkpoint = CheckpointManager.Config(enable=True, interval=7, async_mode="async", keep_latest_k=3)

    config = stream_checkpoints(Trainer(), stream_mode="host")
    assert type(config.checkpoint) is StreamCheckpointManager.Config
    assert (config.checkpoint.enable, config.checkpoint.interval, config.checkpoint.async_mode,
            config.checkpoint.keep_latest_k, config.checkpoint.stream_mode) == (True, 7, "async", 3, "host")
    with pytest.raises(ValueError, match="async_mode='async'"):
        StreamCheckpointManager.Config(async_mode="async_with_pinned_mem")
