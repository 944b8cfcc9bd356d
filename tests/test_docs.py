"""The Python examples of the README and of docs/training.md marked ``<!-- runs in
tests/test_docs.py -->`` run as written, on a tiny model on the CPU in a temporary folder: the
README's quick start, and the training loop, which is run, run again as a resumed process would
(a fresh model and optimizer), and compared bit for bit with a run never interrupted."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- runs in tests/test_docs.py -->"
_MARKS = re.compile("^" + re.escape(MARK) + "$", re.MULTILINE)
_BLOCK = re.compile("^" + re.escape(MARK) + r"\n```python\n(.*?)\n```", re.DOTALL | re.MULTILINE)


def examples(doc: str) -> list[str]:
    """The marked Python blocks of ``doc`` (a path from the repository's root)."""
    text = (ROOT / doc).read_text()
    found = _BLOCK.findall(text)
    assert len(found) == len(_MARKS.findall(text)), f"{doc}: a {MARK} line not followed by a ```python block"
    return found


def example_with(doc: str, text: str) -> str:
    """The one marked Python block of ``doc`` that holds ``text``."""
    (found,) = [code for code in examples(doc) if text in code]
    return found


def run(code: str, doc: str, **names: Any) -> dict[str, Any]:
    namespace = dict(names)
    exec(compile(code, doc, "exec"), namespace)  # the example as a reader would paste it
    return namespace


def test_the_readme_quick_start_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (quick_start,) = examples("README.md")
    monkeypatch.chdir(tmp_path)
    done = run(quick_start, "README.md")
    state, loaded = done["state"], done["loaded"]
    assert loaded["step"] == 1
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert torch.equal(loaded["rng"], state["rng"])
    ckptstream.verify(tmp_path / "ckpt.safetensors")


def tiny_training(seed: int) -> dict[str, Any]:
    """What the training loop's example takes as given: a model, its optimizer, next_batch()
    (drawn from the global generator, whose state the loop saves), steps and save_every."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 12), torch.randint(0, 5, (8,))

    return {"model": model, "opt": opt, "next_batch": next_batch, "save_every": 2}


def parameters(done: dict[str, Any]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in done["model"].parameters()]


def test_the_training_loop_runs_and_resumes_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (loop,) = examples("docs/training.md")
    doc = "docs/training.md"
    (tmp_path / "interrupted").mkdir()
    (tmp_path / "whole").mkdir()
    monkeypatch.chdir(tmp_path / "interrupted")
    first = run(loop, doc, steps=5, **tiny_training(seed=1))  # stops after step 5; saved at 2 and 4
    assert ckptstream.CheckpointManager("ckpts").steps() == [2, 4]
    assert first["step"] == 5
    resumed = run(loop, doc, steps=8, **tiny_training(seed=99))  # a new process: other initial weights
    assert resumed["loaded"]["step"] == 4
    assert ckptstream.CheckpointManager("ckpts").steps() == [4, 6, 8]
    monkeypatch.chdir(tmp_path / "whole")
    whole = run(loop, doc, steps=8, **tiny_training(seed=1))
    assert "loaded" not in whole  # nothing to resume from
    for a, b in zip(parameters(resumed), parameters(whole), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(parameters(first), parameters(whole), strict=True):
        assert not torch.equal(a, b)  # the comparison sees training steps


def test_the_accelerate_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.state import AcceleratorState, GradientState

    from ckptstream.accelerate import state_file

    example = example_with("docs/integrations.md", "StreamState")
    monkeypatch.chdir(tmp_path)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        done = run(example, "docs/integrations.md")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    folders = tmp_path / "run" / "checkpoints"
    assert sorted(f.name for f in folders.iterdir()) == ["checkpoint_1", "checkpoint_2"]  # total_limit=2
    saved = ckptstream.load(state_file(folders / "checkpoint_2", 0))
    loaded = done["model"].state_dict()
    assert list(saved["models"][0]) == list(loaded)
    for key, tensor in saved["models"][0].items():
        assert torch.equal(loaded[key], tensor), key
    assert "save_state" not in vars(done["accelerator"])  # the block gave the methods back


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None,
                    reason="needs torchtitan and triton (its model configs import it)")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torchtitan's imports
def test_the_torchtitan_config_module_runs() -> None:
    from torchtitan.config import ConfigManager

    from ckptstream.torchtitan import StreamCheckpointManager

    example = example_with("docs/integrations.md", "llama3_debugmodel_stream")
    config = run(example, "docs/integrations.md")["llama3_debugmodel_stream"]()
    assert type(config.checkpoint) is StreamCheckpointManager.Config
    assert config.checkpoint.interval == 10  # the debug config's, kept
    assert config.checkpoint.last_save_model_only is False
    # torchtitan's command line reaches the new options (tyro, from the registry's default)
    module = types.ModuleType("mytitan_doc")
    module.llama3_debugmodel_stream = run(example, "docs/integrations.md")["llama3_debugmodel_stream"]  # type: ignore[attr-defined]
    sys.modules["mytitan_doc"] = module
    try:
        parsed = ConfigManager().parse_args(["--module", "mytitan_doc", "--config", "llama3_debugmodel_stream",
                                             "--checkpoint.enable", "--checkpoint.async_mode", "async",
                                             "--checkpoint.stream_mode", "lazy"])
    finally:
        del sys.modules["mytitan_doc"]
    assert type(parsed.checkpoint) is StreamCheckpointManager.Config
    assert (parsed.checkpoint.enable, parsed.checkpoint.async_mode, parsed.checkpoint.stream_mode) == (
        True, "async", "lazy")


def test_the_trainer_example_runs_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import GPT2LMHeadModel

    from ckptstream.transformers import state_file

    example = example_with("docs/integrations.md", "StreamTrainer")
    monkeypatch.chdir(tmp_path)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        done = run(example, "docs/integrations.md")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    run_dir = tmp_path / "run"
    assert sorted(f.name for f in run_dir.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert done["trainer"]._initial_global_step == 6  # resumed at 6, not trained from 0 again
    assert done["trainer"].state.global_step == 8
    saved = ckptstream.load(state_file(run_dir / "checkpoint-8", 0))
    loaded = GPT2LMHeadModel.from_pretrained(run_dir / "model").state_dict()
    for key, tensor in done["model"].state_dict().items():
        assert torch.equal(saved["model"][key], tensor), key
        assert torch.equal(loaded[key], tensor), key
