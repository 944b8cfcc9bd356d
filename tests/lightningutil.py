"""Helpers of the Lightning tests: a small LightningModule that exercises what a resume must
restore, a Trainer run that records its losses, and saves held open until someone waits for them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ckptstream import SaveHandle
from ckptstream._checkpoint import save_async

# Lightning's own warnings under this torch and on a machine without a GPU or logger; the
# suite turns warnings into errors.
LIGHTNING_WARNINGS = [
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*GPU available but not used.*"),
    pytest.mark.filterwarnings("ignore:.*in a directory that is not empty.*"),
    pytest.mark.filterwarnings("ignore:.*`weights_only` was not set.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*is smaller than the logging interval.*"),
]

IN_FEATURES, HIDDEN = 64, 4200  # the first layer's weights (and moments), 1.03 MiB, exceed 1 MiB: "lazy"
# streams them from the live tensors instead of copying them at the call
BATCH, SAMPLES = 8, 48  # 6 steps an epoch


class SmallModel(pl.LightningModule):
    """save_hyperparameters, dropout, AdamW and a step-interval scheduler: a resume that misses
    one of them (the RNG, the moments, the LR) does not give the same losses."""

    def __init__(self, hidden: int = HIDDEN, lr: float = 3e-3, dropout: float = 0.25) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(IN_FEATURES, hidden), torch.nn.Dropout(dropout), torch.nn.GELU(), torch.nn.Linear(hidden, 1)
        )
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(seed: int = 1) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, IN_FEATURES, generator=g)
    y = torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def fit(dirpath: Path, io: CheckpointIO | None, *, epochs: int, ckpt_path: str | None = None,
        every: int = 3, top_k: int = 2, monitor: str | None = "step", callbacks: list[Callback] | None = None,
        accelerator: str = "cpu", seed: int = 7, **trainer: Any) -> tuple[SmallModel, pl.Trainer]:
    """A run of ``epochs`` epochs (resumed from ``ckpt_path``), checkpointing every ``every``
    steps into ``dirpath`` through ``io`` (None: Lightning's default); the model's ``losses``
    are those of this run."""
    pl.seed_everything(seed, verbose=False)
    model = SmallModel()
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=top_k, monitor=monitor,
                           mode="max")
    run = pl.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[*(callbacks or []), ckpt],
                     plugins=[io] if io is not None else None, **trainer)
    run.fit(model, data(), ckpt_path=ckpt_path)
    return model, run


def bits(losses: list[torch.Tensor]) -> list[int]:
    """Each loss as the integer of its float32 bits: an exact comparison, also of NaN."""
    return [int(x.float().reshape(1).view(torch.int32).item()) for x in losses]


def files(dirpath: Path) -> list[str]:
    return sorted(os.listdir(dirpath))


# --- saves held open ---------------------------------------------------------------------------


class Holds:
    """Background saves of ckptstream held before they read the state or write a byte, each
    until ``release(path)``; ``released_by_wait`` releases a save when anyone waits for it (its
    ``result()``, or ``wait_staged()``), so that a plug-in that waits for a save before it acts
    proceeds, and one that does not acts while the save is still held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}
        self.log: list[tuple[str, str]] = []  # (what happened, path), in order

    def event(self, path: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(path, threading.Event())

    def release(self, path: str, why: str) -> None:
        event = self.event(path)
        if not event.is_set():
            with self._lock:
                self.log.append((why, os.path.basename(path)))
            event.set()

    def released(self) -> list[tuple[str, str]]:
        """(why, file name) of each save's first release, in order (a wait after a save was
        written releases nothing, but is logged)."""
        seen: set[str] = set()
        out = []
        for why, name in self.log:
            if why not in ("writing", "published") and name not in seen:
                seen.add(name)
                out.append((why, name))
        return out

    def published(self) -> list[str]:
        return [name for why, name in self.log if why == "published"]

    def release_all(self, why: str) -> None:
        with self._lock:
            paths = [p for p, e in self._events.items() if not e.is_set()]
        for path in paths:
            self.release(path, why)


@contextmanager
def held_saves(monkeypatch: pytest.MonkeyPatch, *, released_by_wait: bool = True) -> Iterator[Holds]:
    holds = Holds()
    write = save_async.write_checkpoint  # type: ignore[attr-defined]

    def held_write(plan: Any, path: str, *args: Any, **kwargs: Any) -> None:
        holds.event(path).wait()
        with holds._lock:
            holds.log.append(("writing", os.path.basename(path)))
            del holds._events[path]  # a later save of the path is held anew
        write(plan, path, *args, **kwargs)
        with holds._lock:
            holds.log.append(("published", os.path.basename(path)))

    monkeypatch.setattr(save_async, "write_checkpoint", held_write)  # the worker's call of the writer
    if released_by_wait:
        result, wait_staged = SaveHandle.result, SaveHandle.wait_staged

        def result_released(self: SaveHandle, timeout: float | None = None) -> str:
            holds.release(self.path, "result")
            return result(self, timeout)

        def wait_staged_released(self: SaveHandle, timeout: float | None = None) -> None:
            holds.release(self.path, "wait_staged")
            wait_staged(self, timeout)

        monkeypatch.setattr(SaveHandle, "result", result_released)
        monkeypatch.setattr(SaveHandle, "wait_staged", wait_staged_released)
    try:
        yield holds
    finally:
        holds.release_all("the test's end")  # a failing test leaves no worker waiting


class AtBatchEnd(Callback):
    """Calls ``then(global_step)`` at every train batch end (before ModelCheckpoint, which
    Lightning runs last)."""

    def __init__(self, then: Callable[[int], None]) -> None:
        self.then = then

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.then(trainer.global_step)


def assert_same(ours: Any, theirs: Any, path: str = "checkpoint", *, same_text: Callable[[str], str] = str) -> None:
    """``ours`` equals ``theirs`` exactly: the same container types and keys in the same order,
    tensors of the same dtype, shape and bits, and the same leaves (text through ``same_text``,
    which maps away what differs by design, such as the checkpoint directory)."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), path
        assert torch.equal(_raw(ours), _raw(theirs)), f"{path}: the bits differ"
    elif isinstance(theirs, dict):
        assert [same_text(str(k)) for k in ours] == [same_text(str(k)) for k in theirs], f"{path}: the keys differ"
        for (k, a), b in zip(ours.items(), theirs.values(), strict=True):
            assert_same(a, b, f"{path}[{k!r}]", same_text=same_text)
        assert getattr(ours, "_metadata", None) == getattr(theirs, "_metadata", None), f"{path}: _metadata"
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{path}[{i}]", same_text=same_text)
    elif isinstance(theirs, str):
        assert same_text(ours) == same_text(theirs), path
    else:
        assert ours == theirs or (ours != ours and theirs != theirs), f"{path}: {ours!r} != {theirs!r}"


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8) if t.numel() else t.detach().cpu()
