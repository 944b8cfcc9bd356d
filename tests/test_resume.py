"""Bit-exact resume of a real training loop (examples/train_gpt.py: dropout, a shuffled
DataLoader with workers, AdamW, an LR schedule, every RNG; on the GPU bf16 weights with fp32
master weights): N steps in one process against k steps, a save, the exit, and N - k steps in a
new process. Losses and gradient norms are compared as integers, the restored state bit for bit."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.resume.trainutil import differences, run_child

N, SAVE_EVERY, STOP = 14, 3, 10  # the run stops after step 10; the newest checkpoint is step 9, mid-epoch
EPOCH = 8  # batches per epoch (64 samples, batch 8): the resumed run crosses into epoch 1


def train(tmp_path: Path, name: str, *example: str, hooks: tuple[str, ...] = (), device: str = "cpu",
          ckpts: str = "ckpts") -> dict[int, tuple[int, int]]:
    """Run the example (with ``hooks``); its (loss bits, gradient norm bits) by step."""
    log = tmp_path / f"{name}.jsonl"
    run_child("child_train.py", *hooks, "--", "--steps", str(N), "--ckpt-dir", str(tmp_path / ckpts),
              "--log", str(log), "--device", device, "--workers", "2", *example, timeout=300)
    return {r["step"]: (r["loss_bits"], r["grad_norm_bits"]) for r in map(json.loads, log.read_text().splitlines())}


_RUNS: dict[tuple[str, str], dict[str, Any]] = {}


def runs(factory: pytest.TempPathFactory, device: str, mode: str) -> dict[str, Any]:
    """Once per device and mode, two processes at a time: the reference run and the interrupted
    run, then the resume and a resume that forgets the RNG state (from a copy of the checkpoints)."""
    if (device, mode) not in _RUNS:
        tmp = factory.mktemp(f"resume-{device}-{mode}")
        with ThreadPoolExecutor(2) as pool:
            ref = pool.submit(train, tmp, "reference", "--save-every", "0", device=device, ckpts="unused")
            first = pool.submit(train, tmp, "first", "--save-every", str(SAVE_EVERY), "--stop-after", str(STOP),
                                "--mode", mode, hooks=("--dump-saved", "9", str(tmp / "saved.pt")), device=device)
            found: dict[str, Any] = {"reference": ref.result(), "first": first.result()}
            shutil.copytree(tmp / "ckpts", tmp / "ckpts-copy")
            resumed = pool.submit(train, tmp, "resumed", "--save-every", str(SAVE_EVERY), "--resume", "--mode", mode,
                                  hooks=("--dump-restored", str(tmp / "restored.pt")), device=device)
            forgot = pool.submit(train, tmp, "forgot", "--save-every", "0", "--resume", hooks=("--forget-rng",),
                                 device=device, ckpts="ckpts-copy")
            found.update(resumed=resumed.result(), forgot=forgot.result())
        found["saved"] = torch.load(tmp / "saved.pt", weights_only=True)
        found["restored"] = torch.load(tmp / "restored.pt", weights_only=True)
        _RUNS[device, mode] = found
    return _RUNS[device, mode]


def check_bit_exact(found: dict[str, Any]) -> None:
    ref, before, after = found["reference"], found["first"], found["resumed"]
    assert sorted(ref) == list(range(1, N + 1))
    assert before == {s: ref[s] for s in range(1, STOP + 1)}  # saving changed nothing
    assert sorted(after) == list(range(10, N + 1))  # resumed after step 9: step 10 runs again
    assert after[10][1] == ref[10][1]  # the first resumed gradient norm
    assert after == {s: ref[s] for s in range(10, N + 1)}  # every loss and norm, bit for bit
    saved, restored = found["saved"], found["restored"]
    assert differences(restored, saved) == []  # every tensor, RNG state and position
    assert saved["data"] == {"epoch": 1, "batch": 1}
    assert saved["step"] == 9
    assert saved["optim"]["state"]
    assert "python" in saved["rng"]
    assert "torch" in saved["rng"]


def check_forgotten_rng_shows(found: dict[str, Any]) -> None:
    """The planted bug of forgetting the generators (dropout's masks) must show."""
    ref, forgot = found["reference"], found["forgot"]
    assert sorted(forgot) == list(range(10, N + 1))
    assert forgot[10] != ref[10]  # the same weights and data, other dropout masks


def test_resume_is_bit_exact_on_the_cpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    check_bit_exact(runs(tmp_path_factory, "cpu", "device"))


def test_resume_without_the_rng_state_goes_another_way(tmp_path_factory: pytest.TempPathFactory) -> None:
    check_forgotten_rng_shows(runs(tmp_path_factory, "cpu", "device"))


@pytest.mark.slow
def test_resume_is_bit_exact_on_the_cpu_in_lazy_mode(tmp_path_factory: pytest.TempPathFactory) -> None:
    check_bit_exact(runs(tmp_path_factory, "cpu", "lazy"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["device", "lazy", "host"])
def test_resume_is_bit_exact_on_the_gpu_with_bf16_and_master_weights(
        mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    found = runs(tmp_path_factory, "cuda", mode)
    check_bit_exact(found)
    check_forgotten_rng_shows(found)
    saved = found["saved"]
    assert saved["model"]["wte.weight"].dtype == torch.bfloat16
    assert saved["master"][0].dtype == torch.float32
    assert "cuda" in saved["rng"]
