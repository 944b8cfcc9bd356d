"""torchtitan's own entry point (``torchtitan.train``) on a CPU, that tests/test_torchtitan_resume.py
kills and resumes.

    child_torchtitan.py ARGS...   (torchtitan.train's arguments, e.g. --module titan_configs
                                   --config cpu_stream --checkpoint.enable ...)

torchtitan 0.3.0 picks "cuda" when no accelerator is found and calls
``torch.distributed.set_timeout``, which torch 2.13 does not have: before torchtitan is imported,
this process makes "cpu" the device where CUDA is absent (with the few memory-statistics
functions torchtitan asks of a device module) and adds ``set_timeout`` from ``distributed_c10d``
where torch lacks it. Nothing of the checkpointer
is changed. It prints "resumed N" (or "fresh") once the checkpointer loaded, then "step N LOSS"
per step (the loss as float.hex).
"""

from __future__ import annotations

import runpy
import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch._utils
import torch.distributed as dist
from torch.distributed import distributed_c10d

CPU = types.SimpleNamespace(
    set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1, is_available=lambda: True,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
    reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
    memory_stats=lambda device=None: {}, synchronize=lambda device=None: None,
)


def on_cpu() -> None:
    device_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind="cuda": CPU if kind == "cpu" else device_module(kind)  # type: ignore[assignment]


def with_set_timeout() -> None:
    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout: timedelta, group: Any = None) -> None:
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def report() -> None:
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.components.metrics import MetricsProcessor

    load, log = BaseCheckpointManager.load, MetricsProcessor.log

    def loaded(self: Any, step: int = -1) -> bool:
        done = load(self, step)
        print(f"resumed {self.states['train_state'].step}" if done else "fresh", flush=True)
        return bool(done)

    def logged(self: Any, step: int, loss: float, *args: Any, **kwargs: Any) -> None:
        print(f"step {step} {float(loss).hex()}", flush=True)
        log(self, step, loss, *args, **kwargs)

    BaseCheckpointManager.load = loaded
    MetricsProcessor.log = logged


if __name__ == "__main__":
    if not torch.cuda.is_available():
        on_cpu()
    with_set_timeout()
    report()
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__")
