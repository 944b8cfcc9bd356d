"""StreamCheckpointIO(mode="device") in a short Lightning run on a GPU: the snapshot of every
checkpoint holds the state at its step while training goes on, and a resume from a ckptstream
file gives the losses of the same resume from a file of Lightning's own checkpoint IO."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream.lightning import StreamCheckpointIO
from tests.lightningutil import LIGHTNING_WARNINGS, assert_same, bits, files, fit

pytestmark = [*LIGHTNING_WARNINGS, pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:.*The dirpath has changed.*")]


class TeeIO(StreamCheckpointIO):
    """StreamCheckpointIO that also keeps a CPU copy of each checkpoint as it was handed over."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copies: dict[str, Any] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.copies[Path(path).name] = copy.deepcopy(
            _to_cpu(checkpoint))  # synchronously, before training goes on
        super().save_checkpoint(checkpoint, path, storage_options)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = type(value)((k, _to_cpu(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        yield
    finally:  # Trainer(deterministic=True) sets these process-wide
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_device_mode_on_cuda_snapshots_and_resumes(tmp_path: Path, deterministic: None) -> None:
    options: dict[str, Any] = {"accelerator": "cuda", "deterministic": True}
    io = TeeIO("device")
    model, run = fit(tmp_path / "ckpts", io, epochs=2, **options)
    run.save_checkpoint(tmp_path / "end.ckpt")
    resumed, _ = fit(tmp_path / "resumed", io, epochs=4, ckpt_path=str(tmp_path / "end.ckpt"), **options)
    io.teardown()
    assert files(tmp_path / "ckpts") == ["epoch=1-step=12.ckpt", "epoch=1-step=9.ckpt"]
    loader = StreamCheckpointIO()
    for name in [*files(tmp_path / "ckpts"), "end.ckpt"]:
        path = tmp_path / "ckpts" / name if name != "end.ckpt" else tmp_path / name
        ckptstream.verify(path)
        assert_same(loader.load_checkpoint(path), io.copies[name], name)

    # the same resume from a file of Lightning's own checkpoint IO, holding what was handed over
    torch.save(io.copies["end.ckpt"], tmp_path / "end-torch.ckpt")
    reference, _ = fit(tmp_path / "reference", None, epochs=4, ckpt_path=str(tmp_path / "end-torch.ckpt"),
                       **options)
    assert len(bits(resumed.losses)) == 12
    assert bits(resumed.losses) == bits(reference.losses)
    assert all(loss.is_cuda for loss in model.losses)
