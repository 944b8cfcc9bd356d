"""A tiny GPT-like model trained with Accelerate, that tests/test_accelerate_resume.py kills and resumes.

    child_accelerate.py DIR SAVER MODE [HOLD]
    SAVER "stream" (``StreamState(accelerator, mode)``; MODE "sync" for mode=None) or "default"
    (Accelerate's own save_state). Trains STEPS steps on a shuffled dataloader (seedable sampler,
    set_epoch) with dropout, AdamW, a LambdaLR warmup and a registered progress counter, calling
    ``save_state()`` every SAVE_EVERY steps with automatic naming under DIR (total_limit=2). A
    process that finds a checkpoint resumes with ``load_state()`` and ``skip_first_batches``.
    Prints "resumed N" (or "fresh"), then "step N LOSS" per step (the loss as float.hex), and at
    the end writes DIR/final.safetensors (the model's weights) and prints "done". HOLD "first_publish"
    stops the first save just before the rename that publishes its file, prints "held" and waits
    there to be killed: a moment too narrow to hit by timing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptstream

VOCAB, CONTEXT, WIDTH, HEADS = 40, 8, 32, 2
SEQUENCES, BATCH, STEPS, SAVE_EVERY = 64, 8, 36, 3  # 8 steps an epoch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))
        self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks, self.ln = nn.Sequential(Block(), Block()), nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.tok(tokens) + self.pos)))


class Progress:
    """The loop's position, saved as a registered object."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


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


def main(directory: str, saver: str, mode: str) -> None:
    torch.manual_seed(0)
    data = torch.randint(0, VOCAB, (SEQUENCES, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    # the loader's own generator: making an iterator (a resume's skip_first_batches) then draws
    # nothing from the global generator that dropout draws from
    loader = DataLoader(TensorDataset(data), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(2))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                              project_config=ProjectConfiguration(project_dir=directory, total_limit=2,
                                                                  automatic_checkpoint_naming=True))
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    stream = None
    if saver == "stream":
        from ckptstream.accelerate import StreamState

        stream = StreamState(accelerator, mode=None if mode == "sync" else mode)
    checkpoints = os.path.join(directory, "checkpoints")
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        accelerator.load_state()  # through the StreamState where there is one
        newest = max(int(f.rsplit("_", 1)[1]) for f in os.listdir(checkpoints))
        accelerator.project_configuration.iteration = newest + 1  # Accelerate's rule: the next folder is new
        print(f"resumed {progress.step}", flush=True)
    else:
        print("fresh", flush=True)
    per_epoch = len(loader)
    while progress.step < STEPS:
        epoch, done = divmod(progress.step, per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        for (batch,) in batches:
            loss = nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            print(f"step {progress.step} {float(loss.item()).hex()}", flush=True)
            if progress.step % SAVE_EVERY == 0:
                accelerator.save_state()
            if progress.step == STEPS:
                break
    if stream is not None:
        stream.close()
    ckptstream.save(accelerator.get_state_dict(model), os.path.join(directory, "final.safetensors"))
    print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[4:] == ["first_publish"]:
        hold_first_publish()
    main(sys.argv[1], sys.argv[2], sys.argv[3])
