#!/usr/bin/env python3
"""Training time that torchtitan's checkpointer costs per checkpoint: its default async modes
(DCP's ``FileSystemWriter``, ``async`` and ``async_with_pinned_mem``) against
``ckptstream.torchtitan.StreamCheckpointManager`` (``async``, ``stream_mode`` device and host).

One process, one device: a stack of Linear+GELU layers (the llama3 debug model's MLP blocks,
widened until model + AdamW state reach ``--gib``) trained by a plain loop that calls the
manager's ``save`` after each step and its wait for staging before each update, as torchtitan's
trainer does. Per system: steps without checkpoints give the step time; then a checkpoint every
``--every`` steps, and the time lost per checkpoint is (the steps' time - steps x step time) /
checkpoints, the last save's write included (waited for at the end). Each system runs under a
deadline (``--deadline`` seconds: stopped there, its figures so far printed); rows are printed
as they are measured.

    python scripts/torchtitan-checkpoint-cost.py                 # on a GPU: >= 1 GiB of state
    python scripts/torchtitan-checkpoint-cost.py --smoke         # a CPU, a tiny model (a check)
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("torchtitan async", "torchtitan async_with_pinned_mem", "ckptstream device", "ckptstream host")


class Deadline(Exception):
    pass


def model_of(gib: float, width: int, device: torch.device) -> nn.Module:
    per_layer = 2 * width * 4 * width * 4 * 3  # two Linear weights, fp32, with AdamW's two moments
    layers = max(1, round(gib * (1 << 30) / per_layer))
    blocks = [nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), nn.Linear(4 * width, width, bias=False))
              for _ in range(layers)]
    return nn.Sequential(*blocks).to(device)


class Stateful:
    def __init__(self, get: Any, put: Any) -> None:
        self.get, self.put = get, put

    def state_dict(self) -> Any:
        return self.get()

    def load_state_dict(self, state: Any) -> None:
        self.put(state)


def manager_for(system: str, folder: Path, model: nn.Module, opt: torch.optim.Optimizer, every: int) -> Any:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torchtitan.components.checkpoint import CheckpointManager

    from ckptstream.torchtitan import StreamCheckpointManager

    if system.startswith("ckptstream"):
        config: Any = StreamCheckpointManager.Config(async_mode="async", stream_mode=system.split()[1])
    else:
        config = CheckpointManager.Config(async_mode=system.split()[1])
    config.enable, config.folder, config.interval, config.keep_latest_k = True, "checkpoint", every, 2
    optimizers = Stateful(lambda: get_optimizer_state_dict(model, opt),
                          lambda s: set_optimizer_state_dict(model, opt, s))
    step = {"step": 0}
    return config.build(dataloader=Stateful(lambda: dict(step), step.update), model_parts=[model],
                        optimizers=optimizers, lr_schedulers=Stateful(dict, lambda s: None),
                        states={"train_state": Stateful(lambda: dict(step), step.update)}, sd_adapter=None,
                        base_folder=str(folder))


def run(system: str, args: argparse.Namespace, device: torch.device, folder: Path) -> None:
    torch.manual_seed(0)
    model = model_of(args.gib, args.width, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=device)
    state_gib = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 30)
    manager = manager_for(system, folder, model, opt, args.every)

    def step(i: int, save: bool) -> float:
        began = time.perf_counter()
        model(x).square().mean().backward()
        manager.maybe_wait_for_staging()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if save:
            manager.save(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    signal.alarm(args.deadline)
    try:
        for i in range(1, 4):  # warm-up: AdamW's state exists before the first save
            step(i, False)
        plain = statistics.median(step(i, False) for i in range(4, 4 + args.steps))
        print(f"{system:34s} state {state_gib:6.2f} GiB  step {plain * 1e3:8.1f} ms", flush=True)
        began, checkpoints, done = time.perf_counter(), 0, 0
        for i in range(1, args.steps + 1):
            step(i, True)
            done += 1
            if i % args.every == 0:
                checkpoints += 1
                lost = (time.perf_counter() - began - done * plain) / checkpoints
                print(f"{system:34s} checkpoint {checkpoints:3d}  lost {lost:8.3f} s per checkpoint", flush=True)
        manager.maybe_wait_for_saving()
        lost = (time.perf_counter() - began - done * plain) / max(1, checkpoints)
        print(f"{system:34s} RESULT lost {lost:8.3f} s per checkpoint ({checkpoints} checkpoints, "
              f"the last write waited for)", flush=True)
    except Deadline:
        print(f"{system:34s} stopped at its deadline ({args.deadline} s)", flush=True)
    finally:
        signal.alarm(0)
        manager.close()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a CPU and a tiny model: a check that it runs")
    parser.add_argument("--gib", type=float, default=1.5, help="model + AdamW state, GiB")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40, help="steps per phase")
    parser.add_argument("--every", type=int, default=10, help="a checkpoint every N steps")
    parser.add_argument("--deadline", type=int, default=50, help="seconds per system")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS)
    args = parser.parse_args()
    if args.smoke:
        args.gib, args.width, args.batch, args.steps, args.every = 0.002, 64, 8, 6, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)

    def deadline(*_: Any) -> None:
        raise Deadline

    signal.signal(signal.SIGALRM, deadline)
    root = Path(args.folder or tempfile.mkdtemp(prefix="titan-cost-"))
    root.mkdir(parents=True, exist_ok=True)  # the store's file goes there: in a missing folder, a hang
    dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo",
                            init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        print(f"device {device}, {args.gib} GiB of state, a checkpoint every {args.every} steps, into {root}",
              flush=True)
        for system in args.systems:
            if device.type != "cuda" and system.endswith("pinned_mem"):  # DCP's stager needs an accelerator
                print(f"{system:34s} skipped: needs a GPU", flush=True)
                continue
            try:
                run(system, args, device, root / system.replace(" ", "-"))
            except Exception as e:  # one system's failure leaves the others' figures
                print(f"{system:34s} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
