"""A load into host memory whose file the page cache holds gets more readers (hot_io_threads,
up to the cores), the same staging split among them; a load into a GPU keeps io_threads. The
tensors arrive byte-exact either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream._engine import read
from ckptstream._settings import Settings


def spy_tune(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    chosen: list[Settings] = []
    tune = read.ReadEngine.tune

    def spy(self: read.ReadEngine, cfg: Settings, *args: object) -> Settings:
        chosen.append(tune(self, cfg, *args))  # type: ignore[arg-type]
        return chosen[-1]

    monkeypatch.setattr(read.ReadEngine, "tune", spy)
    return chosen


def test_a_hot_load_into_host_memory_gets_more_readers(tmp_path: Path, device: torch.device,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no more readers to give")
    gen = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(17 << 20, generator=gen), "b": torch.randint(-9, 9, (1001, 4099), generator=gen,
                                                                          dtype=torch.int16)}
    path = tmp_path / "hot.safetensors"
    ckptstream.save(state, path)
    with open(path, "rb") as f:  # in the page cache, whole
        while f.read(16 << 20):
            pass
    chosen = spy_tune(monkeypatch)
    with ckptstream.settings(io_threads=1, num_buffers=2, buffer_size=8 << 20, hot_io_threads=2):
        loaded = ckptstream.load(path, device=device, mmap=False)
    assert chosen
    if device.type == "cpu":
        assert chosen[-1].io_threads == 2, chosen
        assert chosen[-1].buffer_size * chosen[-1].num_buffers <= 16 << 20  # the same staging, split
    else:
        assert chosen[-1].io_threads == 1, chosen
    for name, t in state.items():
        assert loaded[name].device.type == device.type
        assert torch.equal(loaded[name].cpu(), t)
