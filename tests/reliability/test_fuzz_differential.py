"""Differential fuzzing against safetensors' own reader: a file that ckptstream.load accepts as a
flat state must load to what ``safetensors.safe_open(path, "pt")`` reads from it (the same keys,
and tensors of the same dtype, shape and bytes); where safetensors rejects the file, to what its
header describes, byte for byte (read here by a decoder of a few lines); and a plain safetensors
file that safetensors reads, ckptstream reads too.

The files: safetensors tables written here, valid and with one change each (offsets, dtypes,
shapes, metadata, padding, extra fields, duplicate keys, trailing or missing bytes), and flat
states of the edge-case tensors saved by ckptstream (tied and overlapping tensors among them),
some with a data byte changed. The crash-only fuzzing in test_fuzz_header.py cannot tell a file
that loads wrong from one that loads right; this can.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

import ckptstream
from ckptstream import CorruptCheckpointError
from tests.helpers import EDGE_CASES
from tests.reliability.fuzzutil import element_bytes, encode_header, frame

DIFFERENTIAL = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.function_scoped_fixture])  # fmt: skip

# safetensors' dtype names, spelled out here rather than taken from ckptstream (an oracle of its own);
# those whose torch dtype this torch lacks (F8_E8M0 before 2.7, F4 before 2.8) are left out
TORCH_DTYPES = {name: getattr(torch, attr) for name, attr in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}.items() if hasattr(torch, attr)}  # fmt: skip
HALVED = {"F4"}  # two 4-bit elements a byte: the header's last dimension is twice torch's
STORABLE = [c for c in EDGE_CASES if c.dtype in TORCH_DTYPES.values()]  # complex128 has no safetensors name


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n // 2 if dtype in HALVED else n * TORCH_DTYPES[dtype].itemsize


# --- what each reader makes of a file -----------------------------------------------------------


def ckptstream_reads(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The flat state ckptstream loads and, per key, the table name it is stored under; None if
    it rejects the file (with CorruptCheckpointError: any other exception fails the test)."""
    try:
        state = ckptstream.load(path)
        with ckptstream.open(path) as reader:
            entries = reader.entries()
    except CorruptCheckpointError:
        return None
    stored_as: dict[str, str] = {}
    for e in entries:
        assert len(e.path) == 1 and isinstance(e.path[0], str), e.path  # noqa: PT018 (one fact: a flat key)
        stored_as[e.path[0]] = e.stored_as
    assert type(state) is dict, state
    assert all(isinstance(v, torch.Tensor) for v in state.values()), state
    return state, stored_as


def safetensors_reads(path: Path) -> dict[str, torch.Tensor] | None:
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except (SafetensorError, ValueError, TypeError, OverflowError, RuntimeError):
        return None


def described(raw: bytes) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """Per table name, the dtype, shape and bytes the header gives it (for a file ckptstream
    accepts, so its header is well formed)."""
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + n])
    table.pop("__metadata__", None)
    out = {}
    for name, entry in table.items():
        shape = list(entry["shape"])
        if entry["dtype"] in HALVED:
            shape[-1] //= 2
        begin, end = entry["data_offsets"]
        out[name] = (TORCH_DTYPES[entry["dtype"]], tuple(shape), raw[8 + n + begin : 8 + n + end])
    return out


def check_against_safetensors(path: Path, plain: bool) -> str:
    """The differential property on one file (``plain``: no ckptstream metadata, no duplicate
    key, so safetensors accepting it means ckptstream must); returns which case it was."""
    ours, theirs = ckptstream_reads(path), safetensors_reads(path)
    if ours is None:
        assert theirs is None or not plain, f"safetensors reads {sorted(theirs or {})}, ckptstream rejects the file"
        return "ckptstream rejects" + (", safetensors reads" if theirs is not None else "")
    state, stored_as = ours
    aliases = {k for k, name in stored_as.items() if name != k}  # tied: stored once, under another key
    assert set(state) == set(stored_as)
    table = described(path.read_bytes())  # a third opinion, and the only one where safetensors rejects
    assert set(state) - aliases == set(table), (sorted(state), sorted(table))
    for key, t in state.items():
        assert (t.dtype, tuple(t.shape), element_bytes(t)) == table[stored_as[key]], key
    if theirs is None:
        return "ckptstream reads, safetensors rejects"
    assert set(state) - aliases == set(theirs), (sorted(state), sorted(theirs))
    assert set(stored_as.values()) == set(theirs)
    for key, t in state.items():
        other = theirs[stored_as[key]]
        assert (t.dtype, t.shape) == (other.dtype, other.shape), key
        assert element_bytes(t) == element_bytes(other), key
    return "both read"


# --- safetensors tables written here ------------------------------------------------------------

names = st.text(st.sampled_from("ab.0_é✓"), min_size=1, max_size=4)
CHANGES = ["none", "metadata", "extra_field", "offset", "dtype_same_size", "dtype_other_size", "reshape",
           "trailing", "truncated", "newline_padding", "duplicate", "huge_empty", "structure", "alias"]  # fmt: skip


@st.composite
def safetensors_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """(the change made, the file's bytes): a table of random tensors back to back in a random
    order, then at most one change."""
    change = draw(st.sampled_from(CHANGES))
    shapes = {}
    for name in draw(st.lists(names, max_size=5, unique=True)):
        dtype = draw(st.sampled_from(sorted(TORCH_DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        if dtype in HALVED and shape:
            shape[-1] *= 2
        shapes[name] = (dtype, shape)
    if change == "huge_empty":
        shapes["huge"] = ("F32", [0, 2**62, 2**62])
    table: dict[str, Any] = {}
    pos = 0
    for name in draw(st.permutations(sorted(shapes))):
        dtype, shape = shapes[name]
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + _nbytes(dtype, shape)]}
        pos += _nbytes(dtype, shape)
    data = random.Random(draw(st.integers(0, 2**32 - 1))).randbytes(pos)
    table = {name: table[name] for name in draw(st.permutations(list(table)))}  # entries in any order
    return change, _changed(draw, change, table, data)


def _changed(draw: st.DrawFn, change: str, table: dict[str, Any], data: bytes) -> bytes:
    meta: Any = draw(st.sampled_from(["absent", None, {}, {"k": "v"}]))
    if change == "metadata":
        meta = draw(st.sampled_from([{"k": 1}, {"k": None}, [], "x", False, 0, {"k": ["v"]}]))
    elif change == "trailing":
        data += draw(st.binary(min_size=1, max_size=8))
    elif change == "truncated" and data:
        data = data[: -draw(st.integers(1, min(8, len(data))))]
    elif change in ("structure", "alias"):  # ckptstream's flat structure, as a writer other than ckptstream might
        nodes = [[n, {"tensor": n}] for n in table]
        if change == "alias" and table:
            nodes.append(["tied", {"tensor": draw(st.sampled_from(sorted(table)))}])
        meta = {"ckptstream.format": "1", "ckptstream.structure": json.dumps({"dict": nodes})}
    elif table:
        _change_entry(draw, change, table[draw(st.sampled_from(sorted(table)))])
    body = encode_header(table if meta == "absent" else {"__metadata__": meta, **table})
    if change == "duplicate" and table:  # the first entry given twice (JSON allows it; its meaning is open)
        first = next(iter(table))
        body = body[:-1] + b"," + encode_header({first: table[first]})[1:-1] + b"}"
    if change == "newline_padding":  # JSON whitespace other than spaces after the table
        body += b"\n" * (-(8 + len(body)) % 8) + b"\t "
    return frame(body, data, pad=change != "newline_padding")


def _change_entry(draw: st.DrawFn, change: str, entry: dict[str, Any]) -> None:
    if change == "extra_field":
        entry["extra"] = draw(st.sampled_from([1, "x", None, [1, 2], {"a": 1}]))
    elif change == "offset":
        entry["data_offsets"][draw(st.integers(0, 1))] += draw(st.sampled_from([-1, 1, 2]))
    elif change in ("dtype_same_size", "dtype_other_size"):
        size = {d: 0 if d in HALVED else TORCH_DTYPES[d].itemsize for d in sorted(TORCH_DTYPES)}
        same = change == "dtype_same_size"  # (its own dtype among them: a dtype of every size)
        entry["dtype"] = draw(st.sampled_from([d for d in size if (size[d] == size[entry["dtype"]]) == same]))
    elif change == "reshape":
        entry["shape"] = draw(st.permutations(entry["shape"])) if draw(st.booleans()) else [1, *entry["shape"], 1]


def test_safetensors_tables_load_as_safetensors_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "case.safetensors"
    outcomes: set[str] = set()

    @DIFFERENTIAL
    @given(safetensors_files())
    def run(case: tuple[str, bytes]) -> None:
        change, raw = case
        path.write_bytes(raw)
        outcomes.add(check_against_safetensors(path, plain=change not in ("duplicate", "structure", "alias")))

    run()
    assert outcomes >= {"both read", "ckptstream rejects"}, outcomes  # the comparisons did run


# --- flat states saved by ckptstream ------------------------------------------------------------


@st.composite
def saved_states(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], bool, int | None]:
    """(a flat state of edge-case tensors, some tied or overlapping, whether to checksum, a data
    byte to change or None)."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))
    cases = draw(st.lists(st.sampled_from(STORABLE), min_size=1, max_size=4, unique_by=lambda c: c.name))
    state = {c.name: c.source("cpu") for c in cases}
    first = state[cases[0].name]
    if draw(st.booleans()):
        state["tied"] = first  # the same tensor under a second key: stored once
    if first.dim() and first.shape[0] > 1 and draw(st.booleans()):
        state["overlap"] = first[1:]  # overlapping, not identical: stored as its own bytes
    return state, draw(st.booleans()), draw(st.none() | st.integers(0, 2**16))


@settings(DIFFERENTIAL, max_examples=200)  # each example saves a file first
@given(saved_states())
def test_saved_flat_states_load_as_safetensors_reads_them(tmp_path: Path, case: tuple[dict[str, torch.Tensor], bool,
                                                                                       int | None]) -> None:
    state, checksum, change = case
    path = tmp_path / "case.safetensors"
    ckptstream.save(state, path, checksum=checksum)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if change is not None and len(raw) > 8 + n:
        raw[8 + n + change % (len(raw) - 8 - n)] ^= 0x20
        path.write_bytes(raw)
    outcome = check_against_safetensors(path, plain=False)
    if change is None:
        assert outcome == "both read", outcome
        loaded = ckptstream.load(path)
        assert list(loaded) == list(state)
        for key, t in state.items():
            assert element_bytes(loaded[key]) == element_bytes(t), key
    elif checksum:
        assert outcome == "ckptstream rejects, safetensors reads", outcome  # the changed byte fails its CRC-32C


@pytest.mark.parametrize("change", ["alias", "structure"])
def test_a_recorded_alias_is_the_only_extra_key(tmp_path: Path, change: str) -> None:
    """A flat structure naming a tensor under a second key: that key is the only one safetensors
    does not list, and it holds the very bytes of the tensor it names."""
    data = bytes(range(1, 25))
    table = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    nodes = [["a", {"tensor": "a"}]] + ([["tied", {"tensor": "a"}]] if change == "alias" else [])
    meta = {"ckptstream.format": "1", "ckptstream.structure": json.dumps({"dict": nodes})}
    path = tmp_path / "case.safetensors"
    path.write_bytes(frame(encode_header({"__metadata__": meta, **table}), data))
    assert check_against_safetensors(path, plain=False) == "both read"
    state = ckptstream.load(path)
    assert sorted(state) == (["a", "tied"] if change == "alias" else ["a"])
    assert all(element_bytes(t) == data for t in state.values())
