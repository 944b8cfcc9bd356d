"""Train a small GPT with checkpoints that do not stop training, and resume it bit for bit.

    python examples/train_gpt.py --steps 300 --save-every 50 --ckpt-dir ckpts
    python examples/train_gpt.py --steps 300 --save-every 50 --ckpt-dir ckpts --resume   # after a crash

On a GPU: bf16 weights, fp32 master weights and AdamW; on the CPU: fp32 weights and AdamW. The
data is a tiny text embedded below, cut into random windows and shuffled by a DataLoader with
worker processes. Every 50 steps the whole training state goes to the CheckpointManager, which
writes it in the background while training goes on; with --resume the run continues from the
newest complete checkpoint and gives the same losses, bit for bit, as a run never interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: set before CUDA starts

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import ckptstream

try:
    import numpy as np
except ImportError:  # numpy's generator is saved only where numpy is there
    np = None

TEXT = """\
A checkpoint is a promise made to a future self: whatever happens to this machine, the work done
so far is not lost. The promise costs time. While the state goes to disk the training waits,
unless the copy is taken aside first and written while the next steps run. Then the only wait is
the copy, and the disk works in the background. A good checkpoint is complete or absent, never
half written; it holds everything the next step depends on: the weights, the optimizer's moments,
the schedule, the position in the data and the state of every random number generator. Restored,
the run goes on as if nothing had happened, and the losses it prints are the same, to the last bit.
"""


class Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(block, block, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        x = x + self.drop(self.proj((self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, block, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2 (saved once, restored shared)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random windows of the text. The window of sample (epoch, i) comes from a generator seeded
    by (seed, epoch, i), not from the worker's generator: whichever worker loads it after a
    resume, it is the same window."""

    def __init__(self, tokens: torch.Tensor, block: int, size: int, seed: int) -> None:
        self.tokens, self.block, self.size, self.seed = tokens, block, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = key
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_000_033 + i)
        start = int(torch.randint(len(self.tokens) - self.block - 1, (1,), generator=g))
        window = self.tokens[start : start + self.block + 1]
        return window[:-1], window[1:]


class EpochSampler(Sampler[tuple[int, int]]):
    """A shuffled order per epoch from (seed, epoch), started at any position: the data's place
    in a checkpoint is just (epoch, batches done)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch, self.start = size, seed, 0, 0

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter([(self.epoch, i) for i in order[self.start :].tolist()])

    def __len__(self) -> int:
        return self.size - self.start


class Run:
    """Everything a training step touches."""

    def __init__(self, args: argparse.Namespace) -> None:
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if cuda else "cpu")
        chars = sorted(set(TEXT))
        tokens = torch.tensor([chars.index(c) for c in TEXT])
        self.model = GPT(len(chars), args.block, args.d_model, args.layers, args.heads, args.dropout)
        self.model.to(self.device, torch.bfloat16 if cuda else torch.float32)
        # bf16 weights compute; fp32 master weights take the updates (the optimizer holds them)
        self.master = [p.detach().float().clone() for p in self.model.parameters()] if cuda else None
        self.params = self.master if self.master is not None else list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = max(1, args.steps // 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(
            (s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
        self.sampler = EpochSampler(args.samples, args.seed)
        self.loader = DataLoader(Windows(tokens, args.block, args.samples, args.seed), args.batch_size,
                                 sampler=self.sampler, drop_last=True, num_workers=args.workers,
                                 persistent_workers=args.workers > 0,
                                 # the workers' seeds come from here, not from the global generator,
                                 # whose dropout masks must not depend on when a loader starts
                                 generator=torch.Generator().manual_seed(args.seed))


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, saving: ckptstream.SaveHandle | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = x.to(run.device), y.to(run.device)
    logits = run.model(x).float()
    # log_softmax + gather: F.cross_entropy has no deterministic CUDA kernel
    loss = -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).mean()
    loss.backward()
    if run.master is not None:
        for master, p in zip(run.master, run.model.parameters(), strict=True):
            master.grad, p.grad = p.grad.float(), None
    norm = nn.utils.clip_grad_norm_(run.params, 1.0)
    if saving is not None:
        saving.wait_staged()  # "lazy": until the save has read the state; "host": this stream waits for its copies
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.sched.step()
    if run.master is not None:
        with torch.no_grad():
            for master, p in zip(run.master, run.model.parameters(), strict=True):
                p.copy_(master)
    return loss.detach(), norm


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        _, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    if np is not None and "numpy" in rng:
        n = rng["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))


def checkpoint_state(run: Run, step: int, epoch: int, batch: int) -> dict[str, Any]:
    """The whole training state. The manager captures its CPU tensors and plain values at the
    call: the step counters and RNG states always belong with these weights."""
    state = {"model": run.model.state_dict(), "optim": run.opt.state_dict(), "sched": run.sched.state_dict(),
             "rng": rng_state(), "data": {"epoch": epoch, "batch": batch}, "step": step}
    if run.master is not None:
        state["master"] = run.master
    return state


def restore(run: Run, ckpts: ckptstream.CheckpointManager) -> tuple[int, int, int]:
    """Fill the live model, master weights and RNG states in place from the newest checkpoint.
    The fresh optimizer has no moments yet: ``load_into`` creates them on the model's device."""
    loaded = ckpts.load_into(checkpoint_state(run, 0, 0, 0))
    run.opt.load_state_dict(loaded["optim"])
    run.sched.load_state_dict(loaded["sched"])
    restore_rng(loaded["rng"])
    return loaded["step"], loaded["data"]["epoch"], loaded["data"]["batch"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="length of the run (sets the LR schedule)")
    p.add_argument("--stop-after", type=int, help="exit after this step (then try --resume)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (0: never)")
    p.add_argument("--ckpt-dir", default="ckpts")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    p.add_argument("--mode", choices=("device", "lazy", "host"), default="device", help="see docs/training.md")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--log", help="append one JSON line per step (loss, gradient norm) to this file")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=64, help="samples per epoch")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def bits(t: torch.Tensor) -> int:
    return int(t.float().cpu().view(torch.int32))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if np is not None:
        np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    run = Run(args)
    step = epoch = batch = 0
    stop = min(args.steps, args.stop_after or args.steps)
    log = open(args.log, "a") if args.log else None  # noqa: SIM115 (closed below)
    with ckptstream.CheckpointManager(args.ckpt_dir, keep=args.keep, mode=args.mode) as ckpts:
        if args.resume and ckpts.latest_step() is not None:
            step, epoch, batch = restore(run, ckpts)
            print(f"resumed from step {step} (epoch {epoch}, batch {batch})")
        saving = None
        while step < stop:
            run.sampler.set_position(epoch, batch * args.batch_size)
            for x, y in run.loader:
                loss, norm = train_step(run, x, y, saving)
                step, batch = step + 1, batch + 1
                if log is not None:
                    log.write(json.dumps({"step": step, "loss": loss.item(), "loss_bits": bits(loss),
                                          "grad_norm_bits": bits(norm)}) + "\n")
                if step % 50 == 0 or step == stop:
                    print(f"step {step:5d}  loss {loss.item():.4f}  lr {run.sched.get_last_lr()[0]:.2e}")
                if args.save_every and step % args.save_every == 0:
                    saving = ckpts.save(checkpoint_state(run, step, epoch, batch), step)
                if step >= stop:
                    break
            else:
                epoch, batch = epoch + 1, 0
    # leaving the block waited for the last save: it is complete now
    if log is not None:
        log.close()


if __name__ == "__main__":
    main()
