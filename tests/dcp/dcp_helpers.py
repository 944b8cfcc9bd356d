"""Helpers of the DCP tests: ranks as real processes, the reference state, single-process DCP.

``run_ranks`` starts one ``dcp_worker.py`` process per rank (a gloo or NCCL group through a
file store in the job's directory) and fails with every rank's output when one fails.
"""

from __future__ import annotations

import inspect
import json
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstream
import ckptstream.dcp
from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
SRC = Path(ckptstream.__file__).resolve().parent.parent
WORKER = HERE / "dcp_worker.py"


SEED = 20240917
EXTRA = {"step": 17, "lr": 0.25, "names": ["a", "b"], "note": "héllo"}


def global_tensors(seed: int = SEED) -> dict[str, torch.Tensor]:
    """The global tensors every rank builds alike (sizes that split unevenly over 2 ranks;
    ``tiny`` leaves rank 1 an empty shard)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.W": torch.randn(37, 19, generator=g),
        "model.V": torch.randn(101, generator=g).to(torch.bfloat16),
        "model.H": torch.randn(3, 5, 8, generator=g).to(torch.float16),
        "ints": torch.randint(-(2**40), 2**40, (7, 5), generator=g),
        "tiny": torch.randn(1, 6, generator=g),
    }


def edge_state() -> dict[str, Any]:
    base = torch.randn(12, 10)
    state: dict[str, Any] = {
        "model": {
            "w": torch.randn(1001, 3),  # 12012 bytes: several 4 KiB chunks, elements cut at their edges
            "bf16": torch.randn(33).to(torch.bfloat16),
            "f64": torch.randn(5, 2, dtype=torch.float64),
            "transposed": base.t(),  # non-contiguous views of one storage
            "strided": base[::3, 1::2],
            "scalar": torch.tensor(2.75),
            "empty": torch.empty(0, 4),
        },
        "int8": torch.randint(-128, 127, (17,), dtype=torch.int8),
        "mask": torch.rand(9) > 0.5,
        "step": torch.tensor(12345, dtype=torch.int64),
        "extra": {"epoch": 3, "name": "run-7", "sizes": [1, 2, 3], "nothing": None},
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["fp8"] = torch.randn(7, 3).to(torch.float8_e4m3fn)
    return state


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert same_bits(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    else:
        assert got == want, where


def fresh_destination(state: dict[str, Any]) -> dict[str, Any]:
    """A poisoned destination of the same structure (2-d tensors column-major: the load writes
    through strides)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = poisoned_like(value)
            if value.dim() == 2:
                out[key] = out[key].t().contiguous().t()
        elif key == "extra":
            out[key] = {"epoch": 0, "name": "", "sizes": [], "nothing": 0}
        elif isinstance(value, dict):
            out[key] = fresh_destination(value)
    return out


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model.W": w, "ints": i}`` as ``{"model": {"W": w}, "ints": i}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *heads, last = key.split(".")
        node = out
        for head in heads:
            node = node.setdefault(head, {})
        node[last] = value
    return out


def plain_value(rank: int) -> torch.Tensor:
    """Each rank's own value of the plain (non-DTensor) tensor ``plain``."""
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(SEED + 1 + rank))


def destination() -> dict[str, Any]:
    """A poisoned full-size state to load dcp_worker's whole checkpoint into, in one process."""
    state = nested({k: poisoned_like(v) for k, v in global_tensors().items()})
    state.update(plain=poisoned_like(plain_value(0)), scalar=torch.tensor(-1.0),
                 extra={"step": 0, "lr": 0.0, "names": [], "note": ""})
    return state


def check_full(state: dict[str, Any]) -> None:
    want = global_tensors()
    for key, value in want.items():
        head, *rest = key.split(".")
        got = state[head][rest[0]] if rest else state[head]
        assert same_bits(got, value), key
    assert state["extra"] == EXTRA
    assert same_bits(state["scalar"], torch.tensor(3.5))
    assert sum(same_bits(state["plain"], plain_value(r)) for r in range(2)) == 1


def rank_local(rank: int) -> dict[str, Any]:
    """A state each rank holds as its own shard (for ckptstream.dcp.as_sharded)."""
    g = torch.Generator().manual_seed(SEED + 10 + rank)
    return {"a": torch.randn(5, 3, generator=g), "b": [torch.randint(0, 9, (4,), generator=g)]}


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def has_hf_reader() -> bool:
    """Whether torch has the HuggingFaceStorageReader that reads DCP_SHARDING_INFO (2.9+)."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401
    except ImportError:
        return False
    return torch_version() >= (2, 9)


def raises_metadata_error(kind: type[BaseException], match: str, fn: Any, *args: Any) -> None:
    """``fn`` (a DCP load) fails because StreamReader.read_metadata raised ``kind`` matching
    ``match``. Before torch 2.9 DCP passes that error on; 2.9+ then tries the rank's own metadata
    and raises an AssertionError, which holds both messages from 2.12 on and neither before: there
    the reader warns with its message."""
    if torch_version() < (2, 9):
        raises_in_dcp(kind, match, fn, *args)
    elif torch_version() >= (2, 12):
        raises_in_dcp(AssertionError, match, fn, *args)
    else:
        with pytest.warns(RuntimeWarning, match=f"ckptstream.dcp: .*{match}"):
            raises_in_dcp(AssertionError, "metadata is None", fn, *args)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = child_env()
    # NVLink multicast stays off on shared GPU hosts
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    env.update(extra or {})
    return env


def start_ranks(scenario: str, workdir: Path, world: int = 2, backend: str = "gloo",
                env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / f"store-{time.monotonic_ns()}"  # a fresh file store per job
    return [subprocess.Popen([sys.executable, str(WORKER), scenario, str(rank), str(world), str(workdir), str(store),
                              backend], env=worker_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for rank in range(world)]


def finish_ranks(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Each rank's (exit code, output); ranks still running at ``timeout`` are killed."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[killed after {timeout} s]"
        results.append((proc.returncode, out))
    return results


def run_ranks(scenario: str, workdir: Path, world: int = 2, timeout: float = 120, backend: str = "gloo",
              env: dict[str, str] | None = None) -> list[str]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's output, or fails with all of it."""
    results = finish_ranks(start_ranks(scenario, workdir, world, backend, env), timeout)
    if any(code != 0 for code, _ in results):
        report = "\n".join(f"--- rank {r} exited {code}:\n{out[-6000:]}" for r, (code, out) in enumerate(results))
        raise AssertionError(f"scenario {scenario!r} failed:\n{report}")
    return [out for _, out in results]


def single_process(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A DCP save or load in this process, without a process group."""
    if "no_dist" in inspect.signature(fn).parameters:
        kwargs["no_dist"] = True
    with warnings.catch_warnings():  # "assuming the intent is to ... in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


def load_1(state: dict[str, Any], path: Path, **reader_options: Any) -> dict[str, Any]:
    single_process(dcp.load, state, storage_reader=ckptstream.dcp.StreamReader(path, **reader_options))
    return state


def save_1(state: dict[str, Any], path: Path, **writer_options: Any) -> None:
    single_process(dcp.save, state, storage_writer=ckptstream.dcp.StreamWriter(path, **writer_options))


def reference(workdir: Path) -> dict[str, Any]:
    """The global state that the workers built (saved by rank 0 with ckptstream.save)."""
    return ckptstream.load(workdir / "reference.safetensors")


def sharding_info(file: Path) -> dict[str, list[int]]:
    with ckptstream.open(file) as reader:
        info = json.loads(reader.metadata["DCP_SHARDING_INFO"])
    return {key: value["saved_offsets"] for key, value in info.items()}


def box(full: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))]


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A destination whose every element differs from what a load should put there."""
    if t.dtype.is_floating_point:  # filled in float32: torch 2.4 has no float8 fill on the CPU
        return torch.full_like(t, float("nan"), dtype=torch.float32).to(t.dtype)
    return torch.full_like(t, -7) if t.dtype != torch.bool else ~t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def raises_in_dcp(kind: type[BaseException], match: str, fn: Any, *args: Any, **kwargs: Any) -> BaseException:
    """Call ``fn`` (a DCP save or load), which must fail with a ``kind`` error matching ``match``
    on some rank: DCP raises each rank's error wrapped in a CheckpointException."""
    import re

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn(*args, **kwargs)
    except CheckpointException as e:
        errors = [error for error, _ in e.failures.values()]
    else:
        raise AssertionError(f"{fn.__name__} did not fail")
    for error in errors:
        if isinstance(error, kind) and re.search(match, str(error)):
            return error
    raise AssertionError(f"no {kind.__name__} matching {match!r} among {errors!r}")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
