"""safetensors compatibility both ways.

A flat ``{str: Tensor}`` state keeps every key a tensor name of the file, for every tensor of
the edge-case table and for views that overlap in memory (a tensor repeated under several keys
is stored once and the other keys recorded as its aliases, as transformers does for tied
weights); nested states keep storing shared memory once. Files that safetensors 0.8 accepts
load (headers written byte by byte here, as safetensors' own tests do), those it rejects are
rejected, and a flat state gets the very offsets and data bytes ``safetensors.torch.save_file``
writes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

import ckptstream
from ckptstream import CorruptCheckpointError
from ckptstream._format import header as _header
from ckptstream._format.header import DTYPE_NAMES
from tests.helpers import DTYPES, FLOAT4, EdgeCase, dtype_name, needs_e8m0, needs_float4, random_tensor
from tests.helpers import EDGE_CASES as EDGE_CASE_TABLE

# --- helpers (kept here: this file stands alone) --------------------------------------------


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))




def as_bytes(t: torch.Tensor) -> bytes:
    """The logical row-major bytes of ``t`` (NaN payloads, -0.0 and the bits of every dtype)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(actual: torch.Tensor, expected: torch.Tensor, key: str) -> None:
    assert (actual.dtype, tuple(actual.shape)) == (expected.dtype, tuple(expected.shape)), key
    assert as_bytes(actual) == as_bytes(expected), f"{key}: bytes differ"


def header_of(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    parsed: dict[str, Any] = json.loads(raw[8 : 8 + n])
    return parsed


def write_file(path: Path, header: dict[str, Any] | str, data: bytes = b"") -> Path:
    """A safetensors file from a header (a dict, or JSON text as it should appear) and data."""
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    body = text.encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


# the library's edge-case table, and float4 in the one-dimensional shape safetensors counts in halves
# (those of its dtypes that safetensors names: complex128 has no name)
STORABLE = [d for d in DTYPES if d in DTYPE_NAMES]
EDGE_CASES = [*(c for c in EDGE_CASE_TABLE if c.dtype in DTYPE_NAMES),
              *([EdgeCase("fp4_one_dim", (3,), FLOAT4)] if FLOAT4 is not None else [])]


def _overlapping_views() -> dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    """Flat states whose tensors share one storage (``t``: 40 random float32 values)."""
    return {
        "whole_and_prefix": lambda t: {"a": t, "b": t[:2]},
        "partial_overlap": lambda t: {"a": t[1:5], "b": t[3:8]},
        "matrix_and_its_transpose": lambda t: {"a": t.view(5, 8), "b": t.view(5, 8).t()},
        "transpose_and_row": lambda t: {"a": t.view(5, 8).t(), "b": t.view(5, 8)[2]},
        "expanded_and_base": lambda t: {"a": t, "b": t[:1].expand(3, 7)},
        "three_chained": lambda t: {"a": t[0:10], "b": t[8:20], "c": t[18:30], "d": t[35:]},
        "same_bytes_other_dtype": lambda t: {"a": t[:8], "b": t[:8].view(torch.int32)},
        "strided_interleaved": lambda t: {"even": t[::2], "odd": t[1::2], "all": t},
    }


OVERLAPS = _overlapping_views()


def check_flat_file(path: Path, state: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """safetensors' readers see exactly the state's keys, less ``aliases`` (key -> the key it
    repeats), each byte for byte; ckptstream gives the whole state back."""
    expected_names = sorted(k for k in state if k not in aliases)
    with safetensors.safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == expected_names
        for key in expected_names:
            assert_same(f.get_tensor(key), state[key], key)
    plain = safetensors.torch.load_file(str(path))
    assert sorted(plain) == expected_names
    for key in expected_names:
        assert_same(plain[key], state[key], key)
    back = ckptstream.load(path)
    assert list(back) == list(state)
    for key, t in state.items():
        assert_same(back[key], t, key)
    with ckptstream.open(path) as reader:
        for key in state:
            assert reader.entry(key).stored_as == aliases.get(key, key)
            assert reader.entry(key).view is None


# --- item 11: flat states keep their keys ---------------------------------------------------


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_flat_edge_case_is_a_tensor_name(case: EdgeCase, tmp_path: Path) -> None:
    state = {"x": case.source("cpu"), "neighbour": random_tensor((3,))}
    ckptstream.save(state, tmp_path / "f.safetensors")
    check_flat_file(tmp_path / "f.safetensors", state, {})


def test_flat_state_of_the_whole_table(tmp_path: Path) -> None:
    state = {c.name: c.source("cpu") for c in EDGE_CASES}
    ckptstream.save(state, tmp_path / "f.safetensors")
    check_flat_file(tmp_path / "f.safetensors", state, {})


@pytest.mark.parametrize("make", list(OVERLAPS.values()), ids=list(OVERLAPS))
def test_flat_overlapping_views_are_each_a_tensor_name(make: Callable[..., dict[str, torch.Tensor]],
                                                       tmp_path: Path) -> None:
    state = make(random_tensor((40,)))
    ckptstream.save(state, tmp_path / "f.safetensors")
    check_flat_file(tmp_path / "f.safetensors", state, {})


def test_flat_overlapping_views_together_with_the_edge_cases(tmp_path: Path) -> None:
    state = {c.name: c.source("cpu") for c in EDGE_CASES}
    for name, make in OVERLAPS.items():
        state.update({f"{name}.{k}": v for k, v in make(random_tensor((40,))).items()})
    ckptstream.save(state, tmp_path / "f.safetensors")
    check_flat_file(tmp_path / "f.safetensors", state, {})


def test_identical_tensors_are_stored_once_with_recorded_aliases(tmp_path: Path) -> None:
    """Not every key is a tensor name here, by design: a tensor repeated under several keys
    (tied weights: ``lm_head.weight is wte.weight``) is stored once, under its first key, and
    the structure records the others as aliases of it, as transformers' ``save_pretrained``
    does. Other views of the same storage stay tensor names of their own."""
    t = random_tensor((40,))
    state = {"wte": t, "lm_head": t, "head_view": t.view(5, 8), "prefix": t[:3], "again": t}
    path = tmp_path / "f.safetensors"
    ckptstream.save(state, path)
    # head_view has its own shape, so it is a tensor of its own, not an alias
    check_flat_file(path, state, {"lm_head": "wte", "again": "wte"})
    back = ckptstream.load(path)
    assert back["wte"] is back["lm_head"] is back["again"]  # the tie comes back


@pytest.mark.parametrize("make", list(OVERLAPS.values())[:5], ids=list(OVERLAPS)[:5])
def test_nested_views_still_store_shared_memory_once(make: Callable[..., dict[str, torch.Tensor]],
                                                     tmp_path: Path) -> None:
    base = random_tensor((40,))
    inner = make(base)
    state = {"model": inner, "step": 7}
    path = tmp_path / "n.safetensors"
    ckptstream.save(state, path)
    with safetensors.safe_open(str(path), "pt") as f:
        (stored,) = f.keys()  # one blob of the shared bytes
        assert stored.endswith(".__storage__")
        blob = f.get_tensor(stored)
    assert blob.numel() <= base.numel() * base.element_size()
    back = ckptstream.load(path)
    assert back["step"] == 7
    ptrs = set()
    for key, t in inner.items():
        assert_same(back["model"][key], t, key)
        ptrs.add(back["model"][key].untyped_storage().data_ptr())
    assert len(ptrs) == 1, "the views no longer share memory"


# --- item 12: what safetensors accepts loads; offsets as safetensors writes them --------------


def _from_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def _accepted_files() -> dict[str, tuple[dict[str, Any] | str, bytes]]:
    data = bytes(range(7, 7 + 8))
    return {
        "metadata_null": ('{"__metadata__":null,"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', data),
        "extra_entry_fields": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "axes": ["x"],
                                      "quant": {"scale": 0.5, "nested": [[1, 2], None]}}}, data),
        "zero_elements_past_int64_strides": ({"w": {"dtype": "F32", "shape": [0, 2**62, 2**62],
                                                    "data_offsets": [0, 0]}}, b""),
        "f4_packed_shape": ({"w": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}, data[:4]),
        "f4_empty": ({"w": {"dtype": "F4", "shape": [0], "data_offsets": [0, 0]}}, b""),
        "f8_e8m0": ({"w": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [0, 3]}}, data[:3]),
        "entries_out_of_offset_order": ({"b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
                                         "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, data[:4]),
        "space_padding": ('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}        ', data[:1]),
        "metadata_only": ('{"__metadata__":{"k":"v"}}', b""),
    }


ACCEPTED = _accepted_files()


def _needing_dtypes(names: list[str]) -> list[Any]:
    """The cases, those of a dtype that older torch lacks (F4, F8_E8M0) skipped there."""
    return [pytest.param(n, marks=needs_float4) if n.startswith("f4_") else
            pytest.param(n, marks=needs_e8m0) if n.startswith("f8_e8m0") else n for n in names]


@pytest.mark.parametrize("name", _needing_dtypes(list(ACCEPTED)))
def test_files_safetensors_accepts_load(name: str, tmp_path: Path) -> None:
    header, data = ACCEPTED[name]
    path = write_file(tmp_path / "x.safetensors", header, data)
    expected = _from_safetensors(path)  # safetensors 0.8 itself accepts the file
    back = ckptstream.load(path)
    assert list(back) == list(expected) or sorted(back) == sorted(expected)
    for key, t in expected.items():
        assert_same(back[key], t, key)
    ckptstream.verify(path)
    with ckptstream.open(path) as reader:
        for key, t in expected.items():
            assert reader.entry(key).shape == tuple(t.shape)
            assert_same(reader.read(key), t, key)


@needs_float4
def test_f4_written_by_safetensors_loads(tmp_path: Path) -> None:
    """safetensors counts F4 elements of 4 bits: its header doubles the last dimension of
    torch's float4_e2m1fn_x2 (two elements a byte); both sides of the file agree."""
    x = random_tensor((3, 4), torch.float4_e2m1fn_x2)
    path = tmp_path / "sf.safetensors"
    safetensors.torch.save_file({"f4": x, "w": random_tensor((2,))}, str(path))
    assert header_of(path)["f4"]["shape"] == [3, 8]
    back = ckptstream.load(path)
    assert_same(back["f4"], x, "f4")
    ours = tmp_path / "ours.safetensors"
    ckptstream.save({"f4": x}, ours)
    assert header_of(ours)["f4"]["shape"] == [3, 8]
    assert_same(_from_safetensors(ours)["f4"], x, "f4")


REJECTED_BY_BOTH = {
    "metadata_false": '{"__metadata__":false,"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata_list": '{"__metadata__":[],"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata_zero": '{"__metadata__":0,"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata_empty_string": '{"__metadata__":"","w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata_value_not_a_string": '{"__metadata__":{"a":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "number_past_float_range": '{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e400}}',
    "f4_odd_last_dimension": '{"w":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}',
    "f4_zero_dimensions": '{"w":{"dtype":"F4","shape":[],"data_offsets":[0,1]}}',
    "shape_past_int64": '{"w":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}}',
}


@pytest.mark.parametrize("name", _needing_dtypes(list(REJECTED_BY_BOTH)))
def test_files_safetensors_rejects_are_rejected(name: str, tmp_path: Path) -> None:
    text = REJECTED_BY_BOTH[name]
    nbytes = json.loads(text)["w"]["data_offsets"][1]
    path = write_file(tmp_path / "x.safetensors", text, bytes(range(nbytes)))
    with pytest.raises((safetensors.SafetensorError, TypeError)):  # its own, or torch's on the shape
        _from_safetensors(path)
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        ckptstream.load(path)


@pytest.mark.parametrize(("dtype", "since", "nbytes"), [("F4", "2.8", 3), ("F8_E8M0", "2.7", 6)])
def test_dtype_this_torch_lacks_is_refused_naming_the_torch_needed(
        dtype: str, since: str, nbytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid file of a dtype this torch has no dtype for (torch 2.4 has neither F4 nor F8_E8M0)
    is refused as unsupported, not as corrupt, saying which torch reads it."""
    monkeypatch.delitem(_header.DTYPES, dtype, raising=False)  # as under a torch without it
    path = write_file(tmp_path / "x.safetensors", {"w": {"dtype": dtype, "shape": [6], "data_offsets": [0, nbytes]}},
                      bytes(range(nbytes)))
    with pytest.raises(ckptstream.UnsupportedTypeError) as e:
        ckptstream.load(path)
    message = str(e.value)
    assert str(path) in message
    assert f"tensor 'w': dtype {dtype} needs torch." in message
    assert f"torch {since} or later" in message


@pytest.mark.parametrize("where", ["tensor", "metadata"])
def test_duplicate_keys_are_refused_saying_why(where: str, tmp_path: Path) -> None:
    """safetensors keeps the last of two entries with one name; JSON leaves it open, so
    another reader may keep the first: the file means two things, and is refused as such."""
    if where == "tensor":
        text = ('{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                '"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')
    else:
        text = '{"__metadata__":{"k":"1","k":"2"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    path = write_file(tmp_path / "dup.safetensors", text, b"ab")
    assert list(_from_safetensors(path)) == ["w"]  # safetensors accepts it
    with pytest.raises(CorruptCheckpointError) as e:
        ckptstream.load(path)
    message = str(e.value)
    assert str(path) in message
    assert ("'w'" in message if where == "tensor" else "'k'" in message)
    assert "twice" in message
    assert "ambiguous" in message


def _all_dtypes_state() -> dict[str, torch.Tensor]:
    """One tensor of each dtype (F4 and F8_E8M0 included), with odd sizes, in an order that is
    neither by dtype nor by name."""
    state = {f"t_{dtype_name(d)}": random_tensor((3, 5) if d != FLOAT4 else (3, 2), d)
             for d in reversed(STORABLE)}
    state.update({"zeta": random_tensor((7,), torch.uint8), "alpha": random_tensor((1,), torch.float64),
                  "scalar": random_tensor((), torch.int16), "empty": random_tensor((0, 4))})
    return state


def test_offsets_and_data_equal_safetensors_save_file(tmp_path: Path) -> None:
    state = _all_dtypes_state()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ckptstream.save(state, ours)
    safetensors.torch.save_file(state, str(theirs))
    a, b = header_of(ours), header_of(theirs)
    a.pop("__metadata__")
    assert a == b  # dtype names, shapes (F4's packed one) and data_offsets, for every tensor
    raw_a, raw_b = ours.read_bytes(), theirs.read_bytes()
    start_a, start_b = (8 + struct.unpack("<Q", r[:8])[0] for r in (raw_a, raw_b))
    assert raw_a[start_a:] == raw_b[start_b:]
    for key, t in safetensors.torch.load_file(str(ours)).items():
        assert_same(t, state[key], key)
