"""Helpers of the background-save, manager and resume tests and of their child scripts: slowed
writes, child processes, deep state comparison.

Kept free of pytest so that the child scripts beside it can import it too.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EXAMPLES = ROOT / "examples"


def slow_chunks(seconds: float) -> None:
    """Make every chunk the write engine writes take ``seconds`` longer (so that a save is
    still streaming when a test acts)."""
    from ckptstream._engine.write import WriteEngine

    real = WriteEngine._write

    def slowed(self: Any, chunk: Any, buf: Any) -> None:
        time.sleep(seconds)
        real(self, chunk, buf)

    WriteEngine._write = slowed  # type: ignore[method-assign]


def run_child(script: str, *args: str, timeout: float = 120, check: bool = True,
              **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``tests/resume/<script>`` in a fresh interpreter; fail with its output when it fails."""
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(**env))
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited with {proc.returncode}:\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def start_child(script: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HERE / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(**env))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def detached(state: Any) -> Any:
    """A deep copy of a state on the CPU (tensors cloned, containers rebuilt, leaves kept)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return type(state)((k, detached(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(detached(v) for v in state)
    return state


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two states differ: keys, container types, tensor dtypes, shapes and bits (NaN
    payloads and -0.0 included), leaves."""
    where = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        same = not a.numel() or torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                                            b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
        return [] if same else [f"{where}: the values differ"]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{path}.{i}" if path else str(i))]
    return [] if a == b or (a != a and b != b) else [f"{where}: {a!r} vs {b!r}"]
