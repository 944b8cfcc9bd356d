"""An FSDP2 run under Accelerate on the GPU, that tests/test_accelerate_fsdp_gpu.py starts with
``torch.distributed.run`` (one GPU per process).

    child_accelerate_fsdp.py DIR
    Trains a small model with FSDP2 (``fsdp_version=2``, SHARDED_STATE_DICT) and AdamW, saves
    with ``accelerator.save_state(DIR/ckpt)`` through ``StreamState``, trains on, loads the
    checkpoint back and checks the model and optimizer states (full tensors, gathered) are the
    saved ones bit for bit; writes "ok" to DIR/rank<r>.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckptstream.accelerate import StreamState


def full(model: Any, opt: Any) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "opt": get_optimizer_state_dict(model, opt, options=options)["state"]}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def main(directory: str) -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(fsdp_plugin=plugin)
    assert acc.distributed_type.name == "FSDP", acc.distributed_type
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)

    def train(steps: int) -> None:
        for _ in range(steps):
            acc.backward(model(torch.randn(16, 32, device=acc.device)).square().mean())
            opt.step()
            opt.zero_grad()

    with StreamState(acc):
        train(3)
        saved = full(model, opt)
        acc.save_state(os.path.join(directory, "ckpt"))
        train(2)
        assert not same(full(model, opt), saved)
        acc.load_state(os.path.join(directory, "ckpt"))
        assert same(full(model, opt), saved)
    with open(os.path.join(directory, f"rank{acc.process_index}"), "w") as f:
        f.write("ok")


if __name__ == "__main__":
    main(sys.argv[1])
