"""Two MULTI_CPU processes (run by ``torch.distributed.run``) that save through a StreamState,
change their state and load it back; tests/test_accelerate_ranks.py reads what each prints.

    child_accelerate_ranks.py DIR
    Prints "rank R ok" where the rank's generators and the model, optimizer and step came back
    exactly, "rank R differs" where not.
"""

from __future__ import annotations

import sys

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
    print(f"rank {acc.process_index} {'ok' if ok else 'differs'}", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
