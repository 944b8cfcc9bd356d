"""The file format: safetensors both ways (the same header entries and data bytes), the
4096-aligned data section, checksums, and every validation error on hand-crafted files, raised
before any tensor is touched."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

import ckptstream
from ckptstream._format.header import DTYPE_NAMES
from tests.helpers import DTYPES, POISON_BYTE, assert_bytes_equal, header_of, poisoned_like, random_bytes, random_tensor

STORABLE_DTYPES = [d for d in DTYPES if d in DTYPE_NAMES]


def safetensors_knows(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors can write ``dtype`` (older versions lack some)."""
    try:
        safetensors.torch.save({"x": torch.empty(1, dtype=dtype)})
    except Exception:
        return False
    return True


INTEROP_DTYPES = [d for d in STORABLE_DTYPES if safetensors_knows(d)]


def flat_state(dtypes: list[torch.dtype]) -> dict[str, torch.Tensor]:
    """A tensor of each dtype and a few more, in an order that is neither by dtype nor by name."""
    state = {f"t_{str(d).removeprefix('torch.')}": random_tensor((3, 5), d) for d in reversed(dtypes)}
    state["transposed"] = random_tensor((6, 4)).t()
    state["scalar"] = random_tensor((), torch.float64)
    state["empty"] = random_tensor((0, 3))
    state["alpha"] = random_tensor(7)
    return state


# --- safetensors interop --------------------------------------------------------------------


def test_safetensors_reads_our_flat_file(tmp_path: Path) -> None:
    state = flat_state(INTEROP_DTYPES)
    path = tmp_path / "model.safetensors"
    ckptstream.save(state, path, metadata={"run": "héllo", "step": "12"})
    theirs = safetensors.torch.load_file(path)
    assert sorted(theirs) == sorted(state)
    for name, t in state.items():
        assert_bytes_equal(theirs[name], t)
    with safetensors.safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(state)
        meta = f.metadata()
    assert {k: meta[k] for k in ("run", "step")} == {"run": "héllo", "step": "12"}


def test_safetensors_reads_our_nested_file_by_tensor_names(tmp_path: Path) -> None:
    state: dict[str, Any] = {"model": {"w": random_tensor((2, 3)), "layers": [random_tensor(4)]}, "step": 3}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "ckpt.safetensors")
    assert sorted(theirs) == ["model.layers.0", "model.w"]
    assert_bytes_equal(theirs["model.w"], state["model"]["w"])


def test_header_entries_and_data_match_safetensors(tmp_path: Path) -> None:
    state = flat_state(INTEROP_DTYPES)
    ckptstream.save(state, tmp_path / "ours.safetensors")
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "theirs.safetensors")
    our_start, ours = header_of(tmp_path / "ours.safetensors")
    their_start, theirs = header_of(tmp_path / "theirs.safetensors")
    assert sorted(set(ours) - {"__metadata__"}) == sorted(set(theirs) - {"__metadata__"}) == sorted(state)
    for name in state:
        for field in ("dtype", "shape", "data_offsets"):
            assert ours[name][field] == theirs[name][field], (name, field)
    our_bytes = (tmp_path / "ours.safetensors").read_bytes()
    their_bytes = (tmp_path / "theirs.safetensors").read_bytes()
    assert our_bytes[our_start:] == their_bytes[their_start:]


def test_data_section_starts_on_a_4096_boundary(tmp_path: Path) -> None:
    states = [{}, {"a": random_tensor(1)}, flat_state(STORABLE_DTYPES), {"k" * 5000: random_tensor(2)}]
    for i, state in enumerate(states):
        path = tmp_path / f"{i}.safetensors"
        ckptstream.save(state, path)
        raw = path.read_bytes()
        data_start, _ = header_of(path)
        assert data_start % 4096 == 0
        body = raw[8:data_start]
        assert body.rstrip(b" ").endswith(b"}")  # JSON padded with spaces only
        assert len(raw) == data_start + sum(t.numel() * t.element_size() for t in state.values())


def test_we_read_files_safetensors_writes(device: torch.device, tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in flat_state(INTEROP_DTYPES).items()}
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(state, path, metadata={"format": "pt", "note": "ü"})
    ckptstream.verify(path)
    assert ckptstream.read_metadata(path) == {"format": "pt", "note": "ü"}
    loaded = ckptstream.load(path, device=device)
    assert sorted(loaded) == sorted(state)
    for name, t in state.items():
        assert loaded[name].device.type == device.type
        assert_bytes_equal(loaded[name], t)
    targets = {name: poisoned_like(t).to(device) for name, t in state.items()}
    out = ckptstream.load_into(targets, path)
    for name, t in state.items():
        assert out[name] is targets[name]
        assert_bytes_equal(targets[name], t)


def test_empty_safetensors_file(tmp_path: Path) -> None:
    safetensors.torch.save_file({}, tmp_path / "empty.safetensors")
    ckptstream.verify(tmp_path / "empty.safetensors")
    assert ckptstream.load(tmp_path / "empty.safetensors") == {}


# --- checksums ------------------------------------------------------------------------------


def flip_byte(path: Path, name: str, at: int = 1) -> None:
    data_start, header = header_of(path)
    with open(path, "r+b") as f:
        f.seek(data_start + header[name]["data_offsets"][0] + at)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))


def test_flipped_byte_fails_its_checksum_naming_the_tensor(tmp_path: Path) -> None:
    state = {"a": random_tensor(100), "b": random_tensor((30, 30), torch.bfloat16), "c": random_tensor(9, torch.int8)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    flip_byte(path, "b", at=1000)
    for call in (lambda: ckptstream.verify(path), lambda: ckptstream.load(path),
                 lambda: ckptstream.load(path, settings=ckptstream.Settings(buffer_size=513, num_buffers=2)),
                 lambda: ckptstream.load_into({k: poisoned_like(v) for k, v in state.items()}, path)):  # fmt: skip
        with pytest.raises(ckptstream.CorruptCheckpointError, match=r"tensor 'b' fails its CRC-32C") as e:
            call()
        assert str(path) in str(e.value)
    loaded = ckptstream.load(path, checksum=False)  # the damage is visible, not hidden
    assert_bytes_equal(loaded["a"], state["a"])
    assert loaded["b"].view(torch.uint8).reshape(-1)[1000] == state["b"].view(torch.uint8).reshape(-1)[1000] ^ 0x10


def test_file_without_checksums_verifies_structurally(tmp_path: Path) -> None:
    state = {"a": random_tensor(100), "b": random_tensor(10)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path, checksum=False)
    assert "ckptstream.crc32c" not in header_of(path)[1]["__metadata__"]
    ckptstream.verify(path)
    flip_byte(path, "a")
    ckptstream.verify(path)  # nothing to compare with
    assert_bytes_equal(ckptstream.load(path)["b"], state["b"])


# --- crafted files --------------------------------------------------------------------------


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


A = entry("F32", [1], 0, 4)  # a valid one-tensor table, 4 bytes of data


def with_meta(tree: Any = None, table: dict[str, Any] | None = None,
              meta: dict[str, str] | None = None) -> dict[str, Any]:
    """A header with the tensor table ``table`` (default: ``A``), structure ``tree`` and ``meta``."""
    meta = dict(meta or {})
    if tree is not None:
        meta["ckptstream.structure"] = tree if isinstance(tree, str) else json.dumps(tree)
    return {"__metadata__": meta, **(table or {"a": A})}


def view(*body: Any) -> dict[str, Any]:
    return with_meta({"dict": [["v", {"view": list(body)}]]}, {"a": entry("U8", [8], 0, 8)})


# (id, header as JSON-able or raw bytes, data length, declared header length or None, message fragment)
CRAFTED: list[tuple[str, Any, int, int | None, str]] = [
    ("header_past_end", b"{}", 0, 1000, "runs past the end"),
    ("header_over_100MB", b"{}", 0, 100_000_001, "exceeds the 100000000-byte limit"),
    ("header_length_max", b"{}", 0, 2**64 - 1, "exceeds"),
    ("not_json", b'{"a": ', 0, None, "not valid JSON"),
    ("not_utf8", b'{"\xff": 1}', 0, None, "not valid JSON"),
    ("nan_constant", b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', 4, None, "NaN"),
    ("infinity_constant", b'{"__metadata__": {}, "x": Infinity}', 0, None, "Infinity"),
    ("duplicate_tensor", b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                         b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4, None, "key 'a'"),
    ("duplicate_metadata_key", b'{"__metadata__": {"k": "1", "k": "2"}}', 0, None, "key 'k'"),
    ("not_an_object", [A], 4, None, "must be a JSON object"),
    ("metadata_not_strings", {"__metadata__": {"k": 1}, "a": A}, 4, None, "must map strings to strings"),
    ("entry_not_object", {"a": 4}, 4, None, "expected an object"),
    ("unknown_dtype", {"a": entry("F128", [1], 0, 16)}, 16, None, "unknown dtype 'F128'"),
    ("dtype_not_str", {"a": {**A, "dtype": ["F32"]}}, 4, None, "unknown dtype"),
    ("shape_negative", {"a": entry("F32", [-1], 0, 4)}, 4, None, "non-negative integers"),
    ("shape_float", {"a": entry("F32", [1.0], 0, 4)}, 4, None, "non-negative integers"),  # type: ignore[list-item]
    ("offsets_reversed", {"a": entry("F32", [1], 4, 0)}, 4, None, "data_offsets must be"),
    ("offsets_one", {"a": {**A, "data_offsets": [4]}}, 4, None, "data_offsets must be"),
    ("shape_dtype_mismatch", {"a": entry("F32", [3], 0, 8)}, 8, None, "needs 12 bytes, but its data_offsets span 8"),
    ("hole", {"a": A, "b": entry("F32", [1], 8, 12)}, 12, None, "hole of 4 bytes"),
    ("overlap", {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, None, "overlaps"),
    ("first_not_at_zero", {"a": entry("F32", [1], 4, 8)}, 8, None, "hole of 4 bytes"),
    ("file_longer", {"a": A}, 5, None, "followed by 1 unexpected bytes"),
    ("file_shorter", {"a": entry("F32", [2], 0, 8)}, 4, None, "truncated"),
    ("structure_not_json", with_meta("{"), 4, None, "structure metadata is not valid JSON"),
    ("structure_nan", with_meta('{"float": NaN}'), 4, None, "structure metadata is not valid JSON"),
    ("structure_missing_tensor", with_meta({"dict": [["a", {"tensor": "a"}], ["b", {"tensor": "nope"}]]}), 4, None,
     "b names tensor 'nope', which is not in the tensor table"),
    ("structure_unused_tensor", with_meta({"dict": [["a", {"tensor": "a"}]]}, {"a": A, "b": entry("F32", [1], 4, 8)}),
     8, None, "tensors ['b'] are in the table but not in the structure"),
    ("structure_unknown_node", with_meta({"set": [{"tensor": "a"}]}), 4, None, "unknown structure node 'set'"),
    ("structure_duplicate_key", with_meta({"dict": [["k", {"tensor": "a"}], ["k", 1]]}), 4, None, "duplicate key"),
    ("structure_bad_dict_entry", with_meta({"dict": [["k"]]}), 4, None, "bad dict entry"),
    ("structure_two_tags", with_meta({"tensor": "a", "dict": []}), 4, None, "has keys"),
    ("view_wrong_length", view("a", "F32", [1], [1]), 8, None, "malformed view"),
    ("view_unknown_base", view("b", "F32", [1], [1], 0), 8, None, "malformed view"),
    ("view_base_not_str", view(["a"], "F32", [1], [1], 0), 8, None, "malformed view"),
    ("view_unknown_dtype", view("a", "F128", [1], [1], 0), 8, None, "malformed view"),
    ("view_dtype_not_str", view("a", {"F32": 1}, [1], [1], 0), 8, None, "malformed view"),
    ("view_negative_stride", view("a", "F32", [2], [-1], 4), 8, None, "malformed view"),
    ("view_rank_mismatch", view("a", "F32", [2], [1, 1], 0), 8, None, "malformed view"),
    ("view_out_of_bounds", view("a", "F32", [3], [1], 0), 8, None, "does not fit"),
    ("view_misaligned", view("a", "F32", [1], [1], 2), 8, None, "does not fit"),
    ("crc_wrong_length", with_meta(meta={"ckptstream.crc32c": "0000"}), 4, None, "8 lowercase hex digits"),
    ("crc_not_hex", with_meta(meta={"ckptstream.crc32c": "0000zzzz"}), 4, None, "8 lowercase hex digits"),
    ("crc_uppercase", with_meta(meta={"ckptstream.crc32c": "ABCDEF01"}), 4, None, "8 lowercase hex digits"),
    ("format_version", with_meta(meta={"ckptstream.format": "2"}), 4, None, "format '2'"),
]  # fmt: skip


def craft(path: Path, header: Any, data_len: int, declared: int | None) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    data = random_bytes(data_len).numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(body) if declared is None else declared) + body + data)


@pytest.mark.parametrize(("header", "data_len", "declared", "fragment"), [c[1:] for c in CRAFTED],
                         ids=[c[0] for c in CRAFTED])
def test_crafted_file_is_rejected_before_any_write(header: Any, data_len: int, declared: int | None, fragment: str,
                                                   tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    craft(path, header, data_len, declared)
    target = {"a": poisoned_like(torch.empty(1)), "v": poisoned_like(torch.empty(1))}
    for call in (lambda: ckptstream.load(path), lambda: ckptstream.verify(path),
                 lambda: ckptstream.load_into(target, path, strict=False)):  # fmt: skip
        with pytest.raises(ckptstream.CorruptCheckpointError, match=re.escape(fragment)) as e:
            call()
        assert str(path) in str(e.value)
        assert isinstance(e.value, ValueError)
    assert all(t.view(torch.uint8).eq(POISON_BYTE).all() for t in target.values())


def test_file_too_short_for_the_length_prefix(tmp_path: Path) -> None:
    (tmp_path / "tiny").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ckptstream.CorruptCheckpointError, match="too short for the 8-byte header length"):
        ckptstream.load(tmp_path / "tiny")


def test_extra_entry_fields_are_ignored_as_safetensors_does(tmp_path: Path) -> None:
    path = tmp_path / "extra.safetensors"
    craft(path, {"a": {**A, "x": 1, "note": "ignored"}}, 4, None)
    ckptstream.verify(path)
    assert_bytes_equal(ckptstream.load(path)["a"].view(torch.uint8), path.read_bytes()[-4:])


def test_crafted_file_with_a_valid_structure_loads(tmp_path: Path) -> None:
    """The crafting itself is sound: a header like those above, without a defect, loads."""
    path = tmp_path / "good.safetensors"
    craft(path, view("a", "F32", [1], [1], 4), 8, None)
    loaded = ckptstream.load(path)
    assert list(loaded) == ["v"]
    assert loaded["v"].shape == (1,)
    assert_bytes_equal(loaded["v"].view(torch.uint8), path.read_bytes()[-4:])
