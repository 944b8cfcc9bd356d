"""Resume a freshly built model and AdamW the way the README shows (tests/test_resume_fresh.py).

    child_fresh_optimizer.py save DIR DEVICE WIDTH    train 3 steps, save, train a 4th, keep the 4th's result
    child_fresh_optimizer.py resume DIR DEVICE WIDTH  (a new process) build fresh, load_into, step: the same 4th

"resume" prints a JSON report: whether the 4th step's weights and moments are the same bits,
where the moments and the step counters were created, and the peak host memory the resume
took beyond the process's before it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from torch import nn

import ckptstream
from ckptstream.bench.measure import PeakRss


def build(device: str, width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int, device: str, width: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, width, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def main(what: str, directory: str, device: str, width: int) -> None:
    path = os.path.join(directory, "ckpt.safetensors")
    if what == "save":
        model, opt = build(device, width, seed=0)
        for i in range(3):
            step(model, opt, i, device, width)
        ckptstream.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        step(model, opt, 3, device, width)
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(directory, "after4.pt"))
        return
    model, opt = build(device, width, seed=1)  # other weights: the file's must replace them
    with PeakRss() as peak, warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is skipped: no StateMismatchWarning
        loaded = ckptstream.load_into({"model": model.state_dict(), "optim": opt.state_dict()}, path, strict=False)
    moments = loaded["optim"]["state"][0]
    opt.load_state_dict(loaded["optim"])
    step(model, opt, 3, device, width)
    want = torch.load(os.path.join(directory, "after4.pt"), map_location=device)
    have = {"model": model.state_dict(), "optim": opt.state_dict()}
    same = all(torch.equal(have["model"][k], v) for k, v in want["model"].items()) and all(
        torch.equal(have["optim"]["state"][p][k].cpu(), v.cpu())  # Adam's step stays on the CPU
        for p, s in want["optim"]["state"].items() for k, v in s.items())
    moment_bytes = sum(t.numel() * t.element_size() for s in loaded["optim"]["state"].values() for t in s.values())
    print(json.dumps({"same": same, "exp_avg_device": str(moments["exp_avg"].device),
                      "step_device": str(moments["step"].device), "moment_bytes": moment_bytes,
                      "rss_growth": peak.growth, "staging_bytes": ckptstream.staging_bytes()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
