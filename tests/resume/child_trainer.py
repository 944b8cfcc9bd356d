"""A tiny GPT-2 trained by the Hugging Face Trainer, that tests/test_trainer_resume.py kills and resumes.

    child_trainer.py DIR SAVER MODE [HOLD]
    SAVER "stream" (``StreamTrainer(..., checkpoint_mode=MODE)``; MODE "sync" for None) or
    "default" (``transformers.Trainer`` and its own saver). Trains STEPS steps (a shuffled
    dataset of 64 sequences, batches of 8, dropout, AdamW, a linear warmup and decay), a
    checkpoint every SAVE_EVERY steps in DIR (save_total_limit=2). A process that finds a
    ``checkpoint-*`` folder in DIR (the Trainer's ``get_last_checkpoint``) resumes, as a Trainer
    user's script does, with ``trainer.train(resume_from_checkpoint=True)``: the Trainer picks the
    folder. Prints, as training begins, "resumed N" (N the step it resumed from, 0 where it started
    over) or "fresh", then "step N LOSS" per step (the loss as float.hex), and at the end writes
    DIR/final.safetensors (the model's weights) and prints "done". HOLD "first_publish" stops the
    first save just before the rename that publishes its state file, prints "held" and waits
    there to be killed: a moment too narrow to hit by timing.

    child_trainer.py serve
    Imports transformers once, then for each line "DIR SAVER MODE FIFO [HOLD]" read from stdin
    forks a run as above whose output goes to the named pipe FIFO, prints "pid N", and once it
    ends "exit N STATUS" (STATUS as Popen.returncode: -9 for SIGKILL): a run starts in
    milliseconds instead of the seconds an import of transformers takes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import ckptstream

VOCAB, CONTEXT, SEQUENCES, BATCH, STEPS, SAVE_EVERY = 40, 8, 64, 8, 24, 3  # 8 steps an epoch


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (SEQUENCES, CONTEXT), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class PrintLosses(TrainerCallback):
    """Where training begins ("resumed N" or "fresh"), then each step's loss, exactly (the
    Trainer's own log rounds it), printed as the step ends."""

    def __init__(self, resuming: bool) -> None:
        self.loss: float | None = None
        self.resuming = resuming

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"resumed {state.global_step}" if self.resuming else "fresh", flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"step {state.global_step} {float(self.loss).hex()}", flush=True)  # type: ignore[arg-type]


def trainer_class(saver: str) -> Any:
    base: type[Trainer] = Trainer
    if saver == "stream":
        from ckptstream.transformers import StreamTrainer

        base = StreamTrainer

    class Recording(base):  # type: ignore[valid-type,misc]
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*args, **kwargs)
            self.printer.loss = loss.item()
            return loss

    return Recording


def hold_first_publish() -> None:
    """Stop the first publishing rename of a state file until the process is killed."""
    replace = os.replace

    def held(src: Any, dst: Any, **kwargs: Any) -> None:
        if os.path.basename(os.fsdecode(dst)).startswith("ckptstream_state_"):
            os.write(1, b"held\n")  # one write: the training thread prints whole lines around it
            time.sleep(600)  # the test kills it long before
            raise SystemExit("the held save was never killed")
        replace(src, dst, **kwargs)

    os.replace = held


def main(directory: str, saver: str, mode: str, hold: list[str]) -> None:
    if hold == ["first_publish"]:
        hold_first_publish()
    args = TrainingArguments(output_dir=directory, max_steps=STEPS, save_steps=SAVE_EVERY, save_total_limit=2,
                             per_device_train_batch_size=BATCH, learning_rate=3e-3, warmup_steps=6, weight_decay=0.1,
                             logging_steps=1000, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0, save_strategy="steps")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    resuming = os.path.isdir(directory) and get_last_checkpoint(directory) is not None
    printer = PrintLosses(resuming)
    extra: dict[str, Any] = {} if saver == "default" else {"checkpoint_mode": None if mode == "sync" else mode}
    trainer = trainer_class(saver)(model=model, args=args, train_dataset=Sequences(), callbacks=[printer], **extra)
    trainer.printer = printer
    trainer.train(resume_from_checkpoint=True if resuming else None)
    ckptstream.save(model.state_dict(), os.path.join(directory, "final.safetensors"))
    print("done", flush=True)


def serve() -> None:
    import ckptstream.transformers  # noqa: F401 - imported once, before the forks

    for line in sys.stdin:
        directory, saver, mode, fifo, *hold = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                out = open(fifo, "w", buffering=1)  # noqa: SIM115 - the process ends with os._exit
                os.dup2(out.fileno(), 1)
                sys.stdout = out
                main(directory, saver, mode, hold)
                out.flush()
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"exit {pid} {code}", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.argv[1] == "serve":
        serve()
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
