#!/usr/bin/env python3
"""The time a Hugging Face Trainer loop loses per checkpoint: its own saver against ckptstream's
``StreamTrainer`` (each ``checkpoint_mode``), on a GPT-2 sized to a state of --size-gib (weights
and AdamW's two moments, fp32) on the GPU (on the CPU where there is none: a smoke check).

Each saver trains the same --steps steps in a process of its own, with a checkpoint every
--save-every steps (>= 2), and one run without checkpoints is the baseline. Printed as each run
ends: the loop's time from the end of step 1 to the end of train(), the time lost per
checkpoint against the baseline (the whole loop's, the end of train() included, which waits for
the last background save), and the pause inside each
``_save_checkpoint`` call (the part the loop waits for directly). Each run has a deadline
(--deadline seconds); a run past it is killed and reported so, and the others go on.

    python scripts/trainer-checkpoint-cost.py --size-gib 1.5          # on the GPU machine
    python scripts/trainer-checkpoint-cost.py --size-gib 0.001 --width 32 --vocab 64 --context 16 \\
        --steps 4 --save-every 2 --savers none,default,stream-device      # a smoke check on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SAVERS = ["none", "default", "stream-device", "stream-host", "stream-lazy", "stream-sync"]
VOCAB, CONTEXT, WIDTH, HEADS = 8192, 256, 1024, 16


def layers_for(size_gib: float, width: int, vocab: int = VOCAB, context: int = CONTEXT) -> int:
    """GPT-2 layers for a state of ``size_gib``: 12 bytes a parameter (weights and AdamW's two
    moments), 12 * width**2 parameters a layer, the embeddings beside them."""
    params = size_gib * 2**30 / 12 - (vocab + context) * width
    return max(1, math.ceil(params / (12 * width * width)))


def one_run(saver: str, opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ckptstream.transformers import StreamTrainer

    cuda = torch.cuda.is_available()
    width, steps, save_every, folder = opts.width, opts.steps, opts.save_every, opts.dir
    config = GPT2Config(vocab_size=opts.vocab, n_positions=opts.context, n_embd=width,
                        n_layer=layers_for(opts.size_gib, width, opts.vocab, opts.context),
                        n_head=HEADS if width % HEADS == 0 else 1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    data = torch.randint(0, opts.vocab, (64, opts.context), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in data]
    args = TrainingArguments(folder, max_steps=steps, save_steps=save_every, save_strategy="no" if saver == "none"
                             else "steps", per_device_train_batch_size=4, report_to=[], use_cpu=not cuda,
                             disable_tqdm=True, logging_steps=10**6, dataloader_num_workers=0)
    pauses: list[float] = []
    base: Any = Trainer if saver in ("none", "default") else StreamTrainer
    extra = {} if base is Trainer else {"checkpoint_mode": None if saver == "stream-sync" else saver.split("-")[1]}

    class Timed(base):  # type: ignore[misc,valid-type]
        def _save_checkpoint(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()  # the steps' own work is not the save's
            start = time.perf_counter()
            super()._save_checkpoint(*a, **k)
            pauses.append(time.perf_counter() - start)

    first_step_end: list[float] = []

    class FirstStep(TrainerCallback):
        """The loop's time is taken from the end of step 1: the first step's one-time costs
        (allocations, kernels chosen) are no saver's."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                if cuda:
                    torch.cuda.synchronize()
                first_step_end.append(time.perf_counter())

    trainer = Timed(model=model, args=args, train_dataset=dataset, callbacks=[FirstStep()], **extra)
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    return {"saver": saver, "seconds": time.perf_counter() - first_step_end[0], "pauses": pauses,
            "state_bytes": state_bytes, "layers": config.n_layer,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.5, help="the state's size (weights + AdamW moments)")
    parser.add_argument("--width", type=int, default=WIDTH, help="the model's width (n_embd)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens a sequence (batches of 4)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--savers", default=",".join(SAVERS[:5]), help=f"of {SAVERS} ('none' is the baseline)")
    parser.add_argument("--deadline", type=float, default=45.0, help="seconds a run may take")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp folder)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a run, in a process of its own
    opts = parser.parse_args()
    if opts.one is not None:
        print(json.dumps(one_run(opts.one, opts)))
        return
    if opts.save_every < 2 or opts.steps < opts.save_every:
        parser.error("--save-every must be at least 2 (the loop is timed from the end of step 1) and at most --steps")
    savers = opts.savers.split(",")
    unknown = sorted(set(savers) - set(SAVERS))
    if unknown:
        parser.error(f"unknown savers {unknown}: take from {SAVERS}")
    if "none" in savers:
        savers.remove("none")
    savers.insert(0, "none")  # the baseline first
    root = Path(opts.dir or tempfile.mkdtemp(prefix="trainer-cost-"))
    saves = opts.steps // opts.save_every
    results: list[dict[str, Any]] = []
    baseline: float | None = None
    print(f"{opts.steps} steps, a checkpoint every {opts.save_every} ({saves} checkpoints), under {root}", flush=True)
    for saver in savers:
        folder = root / saver
        command = [sys.executable, __file__, "--one", saver, "--size-gib", str(opts.size_gib), "--width",
                   str(opts.width), "--vocab", str(opts.vocab), "--context", str(opts.context), "--steps",
                   str(opts.steps), "--save-every", str(opts.save_every), "--dir", str(folder)]
        begun = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=opts.deadline)
        except subprocess.TimeoutExpired:
            print(f"{saver:>14}: past its deadline of {opts.deadline:.0f} s, killed", flush=True)
            results.append({"saver": saver, "timed_out": True})
            continue
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the disk for the next run
        if done.returncode != 0:
            print(f"{saver:>14}: failed ({done.returncode}): {done.stderr.strip()[-1500:]}", flush=True)
            results.append({"saver": saver, "failed": done.returncode})
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["process_seconds"] = time.perf_counter() - begun
        results.append(result)
        if saver == "none":
            baseline = result["seconds"]
            print(f"state {result['state_bytes'] / 2**30:.3f} GiB ({result['layers']} layers) on {result['device']}; "
                  f"{saver:>14}: loop {baseline:.2f} s", flush=True)
            continue
        pauses = result["pauses"]
        lost = (result["seconds"] - baseline) / max(1, len(pauses)) if baseline is not None else float("nan")
        result["lost_per_checkpoint"] = lost
        print(f"{saver:>14}: loop {result['seconds']:.2f} s, lost per checkpoint {lost:.3f} s, pause in "
              f"_save_checkpoint {sum(pauses) / max(1, len(pauses)):.3f} s mean, {max(pauses, default=0):.3f} s max "
              f"({len(pauses)} checkpoints)", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2))
    if opts.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
