"""Two MULTI_CPU processes (run by ``torch.distributed.run``) that save through a StreamState,
change their state and load it back; tests/test_accelerate_ranks.py reads what each prints.

    child_accelerate_ranks.py DIR
    Writes "ok" to DIR.rankR where the rank's generators and the model, optimizer and step came
    back exactly, "differs" where not (a file per rank: the ranks share one stdout, and their
    lines can interleave there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from ckptstream.accelerate import StreamState


def main(folder: str) -> None:
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(10 + acc.process_index)  # each rank's generator its own state
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    with StreamState(acc, mode="device") as stream:
        acc.save_state(folder)
        want = (torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()},
                opt.state_dict()["state"][0]["exp_avg"].clone())
        stream.wait()
        acc.wait_for_everyone()
        torch.rand(5)
        acc.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        acc.load_state(folder)
    ok = (torch.equal(torch.get_rng_state(), want[0])
          and all(torch.equal(v, model.state_dict()[k]) for k, v in want[1].items())
          and torch.equal(opt.state_dict()["state"][0]["exp_avg"], want[2]))
    Path(f"{folder}.rank{acc.process_index}").write_text("ok" if ok else "differs")
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
