"""Helpers shared by the reliability tests and their child-process scripts: deterministic
training-like states, deep state comparison, temp-file discovery and resource probes.

Kept free of pytest so that the child scripts beside it can import it too.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ckptstream._engine.buffers import POOL
from tests import helpers
from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
KiB, MiB = 1 << 10, 1 << 20


# --- states ------------------------------------------------------------------------------------


def training_state(version: int, total_bytes: int, pieces: int = 8) -> dict[str, Any]:
    """A nested training-like state of about ``total_bytes``: a model, an optimizer with
    per-parameter state and param_groups, and plain leaves. Every byte depends on ``version``,
    so two versions differ everywhere; building it is cheap (no random generator)."""
    per = max(1, total_bytes // (pieces * 3 * 4))  # float32 elements per tensor (weight, avg, sq)
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, Any]] = {}
    for i in range(pieces):
        n = per + 13 * i  # different sizes: chunk edges fall inside tensors

        def pattern(mul: int, add: int, n: int = n) -> torch.Tensor:
            # distinct finite float32 bit patterns (below 2**30, never NaN), cheap to build
            ints = torch.arange(n, dtype=torch.int32).mul_(mul).add_(add)
            return ints.bitwise_and_((1 << 30) - 1).view(torch.float32)

        model[f"layer{i}.weight"] = pattern(version + 3, i)
        opt_state[i] = {
            "step": torch.tensor(float(version * 10 + i)),
            "exp_avg": pattern(5, version + 11),
            "exp_avg_sq": pattern(7, version + 17),
        }
    model["embed.bias"] = torch.full((5,), version, dtype=torch.bfloat16)
    return {
        "model": model,
        "optim": {
            "state": opt_state,
            "param_groups": [{"lr": 1e-3 * (version + 1), "betas": (0.9, 0.999), "params": list(range(pieces))}],
        },
        "meta": {"version": version, "name": f"run-{version}", "nan": float("nan")},
    }


def small_state(seed: int = 0, scale: int = 1) -> dict[str, Any]:
    """A few-KiB nested state with several dtypes, shared views and non-tensor leaves."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16 * scale, 8, generator=g)
    return {
        "model": {
            "w": w,
            "w_t": w.t(),  # a view of the same storage: stored once, as views
            "b": torch.randn(8 * scale, generator=g).to(torch.bfloat16),
            "mask": torch.rand(33 * scale, generator=g) > 0.5,
            "idx": torch.randint(-(2**40), 2**40, (5 * scale,), generator=g),
            "empty": torch.empty(0, 3),
        },
        "optim": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7 * scale, generator=g)}},
        "step": 7 + seed,
        "lr": 0.5,
        "tags": ("a", None, True),
    }


def assert_same_state(actual: Any, expected: Any, where: str = "<root>") -> None:
    """Equal containers (types, key order), leaves and tensors (dtype, shape, bytes)."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        a = actual.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if a.numel() % 8 == 0 and a.data_ptr() % 8 == 0 and e.data_ptr() % 8 == 0:
            a, e = a.view(torch.int64), e.view(torch.int64)  # much faster than comparing uint8
        assert torch.equal(a, e), f"{where}: tensor bytes differ"
    elif isinstance(expected, (dict, collections.OrderedDict)):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same_state(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{where}.{i}")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{where}: {actual!r} is not nan"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def tensors_of(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf by dotted path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    found: dict[str, torch.Tensor] = {}
    for k, v in items:
        found.update(tensors_of(v, f"{prefix}.{k}" if prefix else str(k)))
    return found


# --- temp files ---------------------------------------------------------------------------------


def temp_name_pattern(name: str) -> re.Pattern[str]:
    """``.NAME.ckptstream-tmp-HOST-[PIDNS-]PID-RAND``: the temp files a save of ``name`` creates
    on this host (group 1: the writer's pid)."""
    host = re.escape(socket.gethostname())
    return re.compile(rf"\.{re.escape(name)}\.ckptstream-tmp-{host}-(?:\d+-)?(\d+)-([0-9a-f]{{12}})")


def temp_files(directory: Path | str, name: str) -> list[str]:
    """Names in ``directory`` that look like temp files of a save of ``name`` (any host)."""
    return sorted(e for e in os.listdir(directory) if e.startswith(f".{name}.ckptstream-tmp-"))


def all_temp_files(directory: Path | str) -> list[str]:
    return sorted(e for e in os.listdir(directory) if ".ckptstream-tmp-" in e)


# --- resources ----------------------------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # not listdir's own descriptor


def engine_threads() -> list[str]:
    """Names of ckptstream's engine threads still alive (they are named ``ckptstream-...``)."""
    return [t.name for t in helpers.engine_threads()]


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def settled_rss_kib() -> int:
    """RSS after a full garbage collection and, on glibc, after returning the allocator's free
    heap memory to the system (otherwise freed tensors keep RSS up by tens of MiB at random)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_kib()


def assert_released() -> None:
    """No engine thread alive and every staging buffer back in the pool."""
    assert engine_threads() == [], engine_threads()
    assert POOL.in_use == 0, POOL.in_use


# --- child processes ----------------------------------------------------------------------------


def child_command(script: str, *args: object) -> list[str]:
    return [sys.executable, str(HERE / script), *map(str, args)]


def run_child(script: str, *args: object, timeout: float = 120, env: dict[str, str] | None = None,
              preexec_fn: Any = None) -> subprocess.CompletedProcess[str]:
    """Run a helper script to completion; its stderr is shown if it fails."""
    proc = subprocess.run(child_command(script, *args), capture_output=True, text=True, timeout=timeout,
                          env=child_env() if env is None else env, preexec_fn=preexec_fn)
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc
