"""Runs of tests/resume/child_trainer.py for the Trainer's tests: one server process imports
transformers once and forks each run, whose output comes back through a named pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

CHILD = Path(__file__).parent / "resume" / "child_trainer.py"


class Runs:
    """The server; ``start`` forks a run and gives its pid and its output lines, ``finish`` waits
    for it and gives its status (as ``Popen.returncode``). ``hold`` "first_publish" stops the
    run's first save before it publishes (the child's HOLD)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.count = folder, 0
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
        self.errors = open(folder / "server-stderr.txt", "w")  # noqa: SIM115 - closed by close()
        self.server = subprocess.Popen([sys.executable, str(CHILD), "serve"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self.errors, text=True, env=env)

    def start(self, directory: Path, saver: str, mode: str, *hold: str) -> tuple[int, IO[str]]:
        assert self.server.stdin is not None
        assert self.server.stdout is not None
        self.count += 1
        fifo = self.folder / f"run-{self.count}.fifo"
        os.mkfifo(fifo)
        self.server.stdin.write(" ".join([str(directory), saver, mode, str(fifo), *hold]) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline().split()
        assert answer[:1] == ["pid"], (answer, self.stderr())
        return int(answer[1]), open(fifo)  # the caller reads it to its end

    def finish(self, pid: int) -> int:
        assert self.server.stdout is not None
        answer = self.server.stdout.readline().split()
        assert answer[:2] == ["exit", str(pid)], (answer, self.stderr())
        return int(answer[2])

    def whole(self, directory: Path, saver: str, mode: str) -> list[str]:
        """A run to its end: its output lines, checked to start and end as a run's do."""
        pid, out = self.start(directory, saver, mode)
        with out:
            lines = out.read().splitlines()
        assert self.finish(pid) == 0, (lines[-3:], self.stderr())
        assert lines[-1] == "done", lines[-3:]
        return lines

    def stderr(self) -> str:
        self.errors.flush()
        return (self.folder / "server-stderr.txt").read_text()[-3000:]

    def close(self) -> None:
        if self.server.stdin is not None:
            self.server.stdin.close()
        self.server.wait(timeout=60)
        if self.server.stdout is not None:
            self.server.stdout.close()
        self.errors.close()


def losses(lines: list[str] | Iterator[str]) -> dict[int, str]:
    return {int(line.split()[1]): line.split()[2] for line in lines if line.startswith("step ")}


def tiny_trainer(output_dir: Path, steps: int, save_every: int, cls: Any = None, **kwargs: Any) -> Any:
    """A Trainer (``StreamTrainer`` unless ``cls``) of a tiny GPT-2 in this process, on the CPU."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ckptstream.transformers import StreamTrainer

    from .resume.child_trainer import Sequences

    optimizers, training, vocab = kwargs.pop("optimizers", None), kwargs.pop("training", {}), kwargs.pop("vocab", 40)
    args = TrainingArguments(output_dir=str(output_dir), max_steps=steps, save_steps=save_every, save_total_limit=2,
                             per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=2, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1000, save_strategy="steps",
                             **training)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=8, n_embd=32, n_layer=2, n_head=2))
    if optimizers == "two groups":
        params: list[torch.nn.Parameter] = list(model.parameters())
        groups: list[dict[str, Any]] = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3)
        optimizers = (optimizer, None)
    extra = {"optimizers": optimizers} if optimizers is not None else {}
    return (cls or StreamTrainer)(model=model, args=args, train_dataset=Sequences(), **extra, **kwargs)
