"""Untrusted files: no code path unpickles or evaluates anything, and a header announcing huge
shapes, offsets or lengths is rejected without allocating them (nor spending long on them)."""

from __future__ import annotations

import ast
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import CorruptCheckpointError
from tests.reliability.fuzzutil import check_file, encode_header, frame, torch_allocations
from tests.reliability.relutil import run_child, small_state

SRC = Path(ckptstream.__file__).resolve().parent
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "copyreg"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__", "breakpoint", "input"}
UNSAFE_CALLS = {("torch", "load"), ("jit", "load"), ("np", "load"), ("numpy", "load"), ("importlib", "import_module"),
                ("torch", "serialization"), ("os", "system"), ("subprocess", "run"),
                ("subprocess", "Popen")}  # fmt: skip
# the benchmark times the peers on files it has just written, in worker processes it starts
BENCH_ALLOWED = {"importlib.import_module", "subprocess.run", "subprocess.Popen"}
# DCP's own .metadata file and its non-tensor values are pickles (its format, not ours):
# ckptstream.dcp reads them through an unpickler that builds only an exact set of DCP's classes
# and plain values (tests/dcp/test_dcp_pickles.py: crafted pickles are refused), and through plain
# pickle only when the caller says trust_metadata=True.
# StreamCheckpointIO(allow_pickle=True) pickles the values its user opted into, and unpickles
# them only under the same opt-in (tests/test_lightning_io.py: refused without it).
PICKLE_ALLOWED = {Path("ckptstream") / "dcp" / "_pickles.py", Path("ckptstream") / "lightning" / "_pickled.py"}


def modules() -> list[Path]:
    found = sorted(SRC.rglob("*.py"))
    assert len(found) > 10, f"no source found under {SRC}"
    return found


def unsafe_uses(tree: ast.AST) -> list[tuple[int, str, ast.AST]]:
    """(line, what, node) for every import, builtin call or attribute call that can run code
    from data."""
    found: list[tuple[int, str, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}", node) for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append((node.lineno, f"from {node.module} import ...", node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in UNSAFE_BUILTINS:
            found.append((node.lineno, f"{node.func.id}(...)", node))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name | ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if (owner, node.attr) in UNSAFE_CALLS or owner in UNSAFE_MODULES:
                found.append((node.lineno, f"{owner}.{node.attr}", node))
    return found


def _weights_only_torch_load(node: ast.AST, tree: ast.AST) -> bool:
    """Whether ``node`` (an attribute torch.load) is called with weights_only=True."""
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and call.func is node:
            return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in call.keywords)  # fmt: skip
    return False


def test_no_code_path_unpickles_or_evaluates() -> None:
    """Every module of the package, by its syntax tree. The benchmark (``bench/``), which times
    the peers on files it has just written itself and which no reader imports, may call
    torch.load with weights_only=True, import the peer systems' modules by name and start its
    worker processes."""
    problems = []
    for path in modules():
        tree = ast.parse(path.read_text(), str(path))
        in_bench = "bench" in path.relative_to(SRC).parts
        for line, what, node in unsafe_uses(tree):
            if in_bench and what == "torch.load" and _weights_only_torch_load(node, tree):
                continue
            if in_bench and what in BENCH_ALLOWED:
                continue
            if path.relative_to(SRC.parent) in PICKLE_ALLOWED and "pickle" in what:
                continue
            problems.append(f"{path.relative_to(SRC.parent)}:{line}: {what}")
    assert problems == []


def test_the_readers_do_not_import_the_benchmark() -> None:
    code = (
        "import sys, ckptstream, ckptstream.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('ckptstream')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "ckptstream.bench" not in out, out


class _Payload:
    """Unpickling this would create a file: the proof that something ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def hostile_files(directory: Path) -> Path:
    """Files whose bytes would run code if anything unpickled or evaluated them."""
    marker = directory / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    ckptstream.save(small_state(), directory / "ours.safetensors", metadata={"pickle": payload.hex()})
    table = {"__metadata__": {"ckptstream.structure": json.dumps({"dict": [["x", {"tensor": "x"}]]}),
                              "__reduce__": "__import__('os').system('touch " + str(marker) + "')"},
             "x": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}  # fmt: skip
    (directory / "pickle_data.safetensors").write_bytes(frame(encode_header(table), payload))
    # a pickle-based file (torch.save) under a safetensors name, and raw pickles
    torch.save({"x": _Payload(marker)}, directory / "torch_save.safetensors")
    (directory / "raw_pickle.safetensors").write_bytes(payload)
    (directory / "pickle_as_header.safetensors").write_bytes(struct.pack("<Q", len(payload)) + payload)
    (directory / "python_expr.safetensors").write_bytes(frame(b"__import__('os').system('touch PWNED')"))
    return marker


def test_hostile_files_run_no_code(tmp_path: Path) -> None:
    marker = hostile_files(tmp_path)
    report = json.loads(run_child("child_audit.py", tmp_path).stdout)
    assert report["events"] == [], "loading a file ran code: " + "; ".join(report["events"])
    assert report["same_outcomes"]
    assert not marker.exists()
    outcomes = report["outcomes"]
    assert "ours.safetensors: ok" in outcomes
    assert "pickle_data.safetensors: ok" in outcomes
    # refused as the formats they are (NotACheckpointError is a CorruptCheckpointError), or as corrupt
    for name, error in (("torch_save", "NotACheckpointError"), ("raw_pickle", "NotACheckpointError"),
                        ("pickle_as_header", "CorruptCheckpointError"), ("python_expr", "CorruptCheckpointError")):
        assert f"{name}.safetensors: {error}" in outcomes, outcomes


# --- huge announcements -------------------------------------------------------------------------

U8 = {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}


def _with_view(*view: Any) -> bytes:
    tree = {"dict": [["a", {"tensor": "a"}], ["v", {"view": ["a", *view]}]]}
    return frame(encode_header({"__metadata__": {"ckptstream.structure": json.dumps(tree)}, "a": U8}), bytes(8))


def _table(**entries: Any) -> bytes:
    return frame(encode_header({name: {"dtype": d, "shape": shape, "data_offsets": offsets}
                                for name, (d, shape, offsets) in entries.items()}))


HUGE: dict[str, bytes] = {
    "header_length_2**63": struct.pack("<Q", 2**63) + b"{}",
    "header_length_just_under_the_limit": struct.pack("<Q", 99_999_999) + b"{}",
    "shape_1e12_elements": _table(a=("F32", [10**6, 10**6], [0, 4 * 10**12])),
    "shape_past_int64": _table(a=("F32", [2**40, 2**40], [0, 2**82])),
    "zero_elements_huge_dims": _table(a=("F32", [0, 2**70], [0, 0])),
    "zero_elements_strides_overflow": _table(a=("U8", [0, 2**62, 2**62], [0, 0])),
    "offset_2**64": _table(a=("U8", [2**64], [0, 2**64])),
    "offsets_far_beyond_the_file": _table(a=("U8", [8], [2**63, 2**63 + 8])) + bytes(8),
    "4000_digit_dims": _table(a=("U8", [10**3999] * 200, [0, 1])) + bytes(1),
    "50000_dims": _table(a=("U8", [1] * 50_000, [0, 1])) + bytes(1),
    "view_past_int64": _with_view("U8", [2**70], [0], 0),
    "view_numel_overflow": _with_view("U8", [2**62, 2**62], [0, 0], 0),
    "view_offset_huge": _with_view("U8", [1], [1], 2**80),
    "view_of_1e12_elements_over_8_bytes": _with_view("U8", [10**12], [0], 0),  # far past the view limit
    "view_of_1_mib_over_8_bytes": _with_view("U8", [1 << 20], [0], 0),  # an expanded view: no copy
}  # fmt: skip
# well-formed: they load, cheaply (safetensors takes element-less shapes whose strides overflow)
VALID = {"50000_dims", "zero_elements_strides_overflow", "view_of_1_mib_over_8_bytes"}


@pytest.mark.parametrize("name", list(HUGE))
def test_huge_announcements_are_rejected_without_allocating(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(HUGE[name])
    check_file(str(path))  # only CkptStreamError, nothing allocated beyond the file's size, quick
    if name not in VALID:
        with pytest.raises(CorruptCheckpointError):
            ckptstream.load(path)
    elif name.startswith("view"):  # an expanded view shares its base's 8 bytes
        with torch_allocations() as allocated:
            state = ckptstream.load(path)
        assert state["v"].shape == (1 << 20,)
        assert state["v"].stride() == (0,)
        assert allocated[0] <= 8
    else:
        with torch_allocations() as allocated:
            state = ckptstream.load(path)
        assert state["a"].numel() == 0 or name == "50000_dims"
        assert allocated[0] <= 1


def test_many_keys_and_one_duplicate_are_rejected_quickly(tmp_path: Path) -> None:
    """Finding the duplicate must not take time quadratic in the number of keys (10000 keys:
    seconds if it did)."""
    n = 10_000
    body = b"{" + b",".join(b'"k%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(n))
    body += b',"k%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' % (n - 1)
    path = tmp_path / "dup.safetensors"
    path.write_bytes(frame(body))
    check_file(str(path))
    with pytest.raises(CorruptCheckpointError, match=f"key 'k{n - 1}'"):  # the duplicate, by name
        ckptstream.load(path)


def test_untrusted_file_with_valid_checksums_still_only_yields_data(tmp_path: Path) -> None:
    """A well-formed hostile file loads as plain tensors and plain JSON values, nothing else."""
    tree = {"dict": [["obj", {"dict": [["__class__", "os.system"], ["__reduce__", {"list": ["echo", "hi"]}]]}],
                     ["t", {"tensor": "t"}]]}  # fmt: skip
    table = {"__metadata__": {"ckptstream.structure": json.dumps(tree)},
             "t": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}
    path = tmp_path / "f.safetensors"
    path.write_bytes(frame(encode_header(table), b"abc"))
    state = ckptstream.load(path)
    assert state == {"obj": {"__class__": "os.system", "__reduce__": ["echo", "hi"]}, "t": state["t"]}
    assert bytes(state["t"].tolist()) == b"abc"
    assert not os.path.exists("hi")
