"""Fuzzing the header codec and the open/parse/load path (_header.decode, ckptstream.open and
every public reader): random bytes, random headers built to pass the early checks, and mutations of
real files. Whatever the input, only CkptStreamError subclasses come out, nothing is allocated
beyond the file's size, and each call returns within a second (fuzzutil.check_file).

Files that must be rejected are checked more strictly: numbers no header may hold (negative and
boolean dimensions, offsets and strides, view offsets off the element grid, views past their blob)
are rejected by every reader with CorruptCheckpointError, while the same file without the fault
loads to the bytes it describes (test_invalid_numbers_are_rejected). test_fuzz_differential.py
compares what the accepted files load to with safetensors' own reader.

The examples are derandomized so CI is reproducible; the `slow` test explores further with
fresh randomness. atheris, where it is installed, fuzzes the same property with coverage
guidance in a child process.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstream
from ckptstream import CorruptCheckpointError
from ckptstream._checksum import crc_of
from ckptstream._format.header import DTYPES
from tests.reliability.fuzzutil import check_file, check_rejected, element_bytes, encode_header, frame
from tests.reliability.relutil import run_child, small_state

# the default run: the same 150 examples every time; test_deep_fuzzing (-m slow) draws 5000 fresh
FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
DEEP = settings(max_examples=5000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

# --- building blocks ----------------------------------------------------------------------------

HUGE = [2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
# JSON true/false are Python ints too: a check on isinstance(v, int) would take them as 1 and 0
ints = st.one_of(st.integers(-3, 40), st.booleans(), st.sampled_from(HUGE), st.integers(-(2**70), 2**70))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=6), st.sampled_from(list(DTYPES)))  # fmt: skip
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
dims = st.lists(st.one_of(st.integers(0, 6), st.sampled_from(HUGE), st.integers(-3, -1), st.booleans()), max_size=4)


def _deep_header(depth: int, in_structure: bool) -> bytes:
    """Nesting around and beyond what the JSON parser and Python's recursion limit take."""
    if not in_structure:
        return b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    tree = '{"list":[' * depth + '{"tensor":"a"}' + "]}" * depth
    a = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    return encode_header({"__metadata__": {"ckptstream.structure": tree}, "a": a})


deep_headers = st.builds(_deep_header, st.integers(1, 5000), st.booleans())


@st.composite
def consistent_table(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A tensor table whose offsets and data length agree, so the fuzzing reaches the structure."""
    table: dict[str, Any] = {}
    pos = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        if draw(st.booleans()) and draw(st.booleans()):  # sometimes: zero elements but huge dims
            shape = [0, *draw(dims)]
        n = DTYPES[dtype].itemsize
        for d in shape:
            n *= d
        table[draw(st.sampled_from(["a", "b", "c", "model.w", "x.__storage__"])) + str(i)] = {
            "dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}  # fmt: skip
        pos += n
    return table, bytes(pos)


def structure(names: list[str]) -> st.SearchStrategy[Any]:
    """Structure trees in ckptstream's JSON encoding, with valid and invalid nodes mixed in."""
    refs = st.sampled_from(names) if names else st.text(max_size=3)
    view = st.tuples(refs | json_values, st.sampled_from(sorted(DTYPES)) | json_values, dims | json_values,
                     dims | json_values, ints).map(list)  # fmt: skip
    leaves = st.one_of(
        scalars,
        st.builds(lambda r: {"tensor": r}, refs | json_values),
        st.builds(lambda v: {"view": v}, view),
        st.builds(lambda f: {"float": f}, st.sampled_from(["nan", "inf", "-inf", "1.0"]) | json_values),
        json_values,
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.builds(lambda kind, items: {kind: items}, st.sampled_from(["dict", "odict"]),
                      st.lists(st.tuples(st.text(max_size=3) | ints, inner).map(list), max_size=4)),
            st.builds(lambda kind, items: {kind: items}, st.sampled_from(["list", "tuple"]),
                      st.lists(inner, max_size=4)),
            st.dictionaries(st.sampled_from(["dict", "list", "tensor", "view", "x"]), inner, max_size=2),
        ),
        max_leaves=10,
    )


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bytes], None]:
    """Write the bytes to one case file and check the property on it."""
    path = tmp_path_factory.mktemp("fuzz") / "case.safetensors"

    def run(data: bytes) -> None:
        path.write_bytes(data)
        check_file(str(path))

    return run


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Real files to mutate: ours without checksums (so mutations reach the structure parser
    instead of stopping at the header checksum), ours with checksums, and safetensors' own."""
    directory = tmp_path_factory.mktemp("seeds")
    files = []
    for i, checksum in enumerate([False, True]):
        path = directory / f"seed{i}.safetensors"
        ckptstream.save(small_state(i), path, metadata={"k": "v"}, checksum=checksum)
        files.append(path.read_bytes())
    from safetensors.torch import save

    files.append(save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.int8)}))
    return files


# --- the fuzz tests -----------------------------------------------------------------------------


@FAST
@given(st.binary(max_size=64) | st.builds(lambda b, d: frame(b, d), st.binary(max_size=200), st.binary(max_size=16)))
def test_random_bytes(case: Callable[[bytes], None], data: bytes) -> None:
    case(data)


@FAST
@given(json_values.map(encode_header) | deep_headers, st.integers(0, 64), st.none() | st.integers(0, 2**64 - 1),
       st.booleans())  # fmt: skip
def test_random_json_headers(case: Callable[[bytes], None], body: bytes, data_len: int, declared: int | None,
                             pad: bool) -> None:
    case(frame(body, bytes(data_len), declared, pad))


@st.composite
def built_files(draw: st.DrawFn) -> bytes:
    table, data = draw(consistent_table())
    meta: Any = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    if draw(st.booleans()):
        meta["ckptstream.structure"] = json.dumps(draw(structure(list(table))))
    if draw(st.booleans()):
        meta["ckptstream.crc32c"] = draw(st.just("0" * 8 * len(table)) | st.text("0123456789abcdefX", max_size=20))
    if draw(st.booleans()):
        meta["ckptstream.header_crc32c"] = draw(st.text("0123456789abcdef", min_size=8, max_size=8))
    if draw(st.booleans()):
        meta = draw(json_values)  # a malformed __metadata__ now and then
    return frame(encode_header({"__metadata__": meta, **table}), data)


@FAST
@given(built_files())
def test_built_headers(case: Callable[[bytes], None], data: bytes) -> None:
    case(data)


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A seed file with a few byte-level or JSON-level changes."""
    raw = bytearray(draw(st.sampled_from(seeds)))
    if draw(st.booleans()):  # JSON level: replace one value somewhere in the header
        (n,) = struct.unpack("<Q", raw[:8])
        table = json.loads(raw[8 : 8 + n])
        node: Any = table
        parent: Any = None
        key: Any = None
        while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)):
            k = draw(st.sampled_from(list(node) if isinstance(node, dict) else list(range(len(node)))))
            if isinstance(node[k], str) and node[k][:1] in "{[" and draw(st.booleans()):
                node[k] = json.loads(node[k])  # descend into the structure, re-encoded below
            parent, key, node = node, k, node[k]
        if parent is not None:
            parent[key] = draw(json_values)
        meta = table.get("__metadata__")
        if isinstance(meta, dict) and not isinstance(meta.get("ckptstream.structure", ""), str):
            meta["ckptstream.structure"] = json.dumps(meta["ckptstream.structure"])
        return frame(encode_header(table), bytes(raw[8 + n :]))
    for _ in range(draw(st.integers(1, 4))):  # byte level
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]))
        at = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[at] = draw(st.integers(0, 255))
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del raw[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del raw[at:]
        else:
            raw += draw(st.binary(min_size=1, max_size=8))
    return bytes(raw)


def test_mutated_files(case: Callable[[bytes], None], seeds: list[bytes]) -> None:
    @FAST
    @given(mutated(seeds))
    def run(data: bytes) -> None:
        case(data)

    run()


@pytest.mark.slow
def test_deep_fuzzing(case: Callable[[bytes], None], seeds: list[bytes]) -> None:
    @DEEP
    @given(st.one_of(built_files(), mutated(seeds), json_values.map(lambda t: frame(encode_header(t)))))
    def run(data: bytes) -> None:
        case(data)

    run()


def test_atheris_fuzzing(tmp_path: Path) -> None:
    """Coverage-guided fuzzing of the same property, where atheris is installed (not a test
    dependency: it needs a matching wheel or a clang toolchain)."""
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    ckptstream.save(small_state(0), corpus / "ours", checksum=False)
    ckptstream.save({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int8)}, corpus / "flat", checksum=False)
    (corpus / "bare").write_bytes(b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')  # framed by the harness
    run_child("child_atheris.py", tmp_path / "case.safetensors", "-runs=3000", "-max_total_time=60", corpus,
              timeout=180)


# --- numbers no header may hold -----------------------------------------------------------------
# A valid file and its twin with one number made invalid in a way that a check on Python's int
# (true is an int), on the byte count alone ([-1, -1, 6] holds 6 elements) or on the bounds alone
# (a float32 view at byte 2) would let through. The valid file loads to the bytes it describes;
# every reader rejects the twin with CorruptCheckpointError, also when the header's own CRC-32C is
# consistent (a crafted file has one), and load_into before writing a byte.

ITEMSIZE = {name: DTYPES[name].itemsize for name in sorted(DTYPES) if name != "F4"}  # F4 counts half-bytes
BLOB = "shared.__storage__"
TABLE_FAULTS = ["negative_dims", "negative_dim", "bool_dim", "float_dim", "bool_offsets"]
VIEW_FAULTS = ["view_negative_dims", "view_negative_stride", "view_bool", "view_bool_offset", "view_float_offset",
               "view_misaligned", "view_past_blob", "view_longer_than_blob"]  # fmt: skip


def _extent(shape: list[int], stride: list[int], itemsize: int) -> int:
    """The bytes a view spans from its offset (none without elements)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize if all(shape) else 0


def _view_bytes(blob: bytes, view: list[Any]) -> bytes:
    """A view's elements in row-major order, gathered one by one from the blob's bytes."""
    _, dtype, shape, stride, offset = view
    size = ITEMSIZE[dtype]
    out = bytearray()
    for index in itertools.product(*(range(n) for n in shape)):
        at = offset + sum(i * s for i, s in zip(index, stride, strict=True)) * size
        out += blob[at : at + size]
    return bytes(out)


@st.composite
def _view(draw: st.DrawFn) -> list[Any]:
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    stride = [draw(st.integers(0, 4)) for _ in shape]
    return [BLOB, dtype, shape, stride, draw(st.integers(0, 3)) * ITEMSIZE[dtype]]


@st.composite
def valid_and_faulty(draw: st.DrawFn) -> tuple[str, dict[str, Any], list[list[Any]], dict[str, Any], list[list[Any]],
                                              int]:
    """(fault, table, views, faulty table, faulty views, blob size): a tensor table with a blob
    that views index, and the same with one fault."""
    fault = draw(st.sampled_from(TABLE_FAULTS + VIEW_FAULTS))
    shapes = {f"t{i}": (draw(st.sampled_from(sorted(ITEMSIZE))), draw(st.lists(st.integers(0, 4), max_size=3)))
              for i in range(draw(st.integers(0, 3)))}  # fmt: skip
    views = draw(st.lists(_view(), min_size=1, max_size=3))
    if fault == "view_misaligned" and ITEMSIZE[views[0][1]] == 1:
        views[0][1] = draw(st.sampled_from([d for d, n in ITEMSIZE.items() if n > 1]))
        views[0][4] = draw(st.integers(0, 3)) * ITEMSIZE[views[0][1]]
    if fault == "view_bool_offset":
        views[0][4] = 0  # the valid file has 0 where its twin has false
    blob = max(v[4] + _extent(v[2], v[3], ITEMSIZE[v[1]]) for v in views) + draw(st.integers(0, 9))
    blob += ITEMSIZE[views[0][1]] if fault == "view_misaligned" else 0  # room to move the view by a byte or more
    shapes[BLOB] = ("U8", [blob])
    table, pos = {}, 0
    for name in draw(st.permutations(sorted(shapes))):  # the blob anywhere in the data
        dtype, shape = shapes[name]
        nbytes = ITEMSIZE[dtype] * math.prod(shape)
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    bad_table, bad_views = json.loads(json.dumps(table)), json.loads(json.dumps(views))
    if fault in TABLE_FAULTS:
        _table_fault(draw, fault, bad_table)
    else:
        _view_fault(draw, fault, bad_views[0], blob)
    return fault, table, views, bad_table, bad_views, blob


def _table_fault(draw: st.DrawFn, fault: str, table: dict[str, Any]) -> None:
    entry = table[draw(st.sampled_from(sorted(table)))]
    shape = entry["shape"]
    if fault == "negative_dims":  # the same element count, so the byte count still agrees
        shape[0:0] = [-1, -1]
    elif fault == "negative_dim":
        shape.insert(draw(st.integers(0, len(shape))), -draw(st.integers(1, 3)))
    elif fault == "bool_dim":  # 1 as true, 0 as false, or a leading true: the same element count
        at = next((i for i, d in enumerate(shape) if d in (0, 1)), None)
        if at is None or draw(st.booleans()):
            shape.insert(0, True)
        else:
            shape[at] = bool(shape[at])
    elif fault == "float_dim":
        shape[0:0] = [1.0]
    else:  # bool_offsets: the tensor at the start of the data begins at false
        entry = next(e for e in table.values() if e["data_offsets"][0] == 0)
        end = entry["data_offsets"][1]
        entry["data_offsets"] = [False, bool(end) if end <= 1 else end]


def _view_fault(draw: st.DrawFn, fault: str, view: list[Any], blob: int) -> None:
    _, dtype, shape, stride, offset = view
    size = ITEMSIZE[dtype]
    if fault == "view_negative_dims":
        shape[0:0], stride[0:0] = [-1, -1], [0, 0]
    elif fault == "view_negative_stride":
        shape[0:0], stride[0:0] = [1], [-draw(st.integers(1, 4))]  # a dimension of one: the extent is the same
    elif fault == "view_bool":  # a 1 or 0 among the sizes and strides as true or false, or a leading true
        spots = [(seq, i) for seq in (shape, stride) for i, v in enumerate(seq) if v in (0, 1)]
        if not spots or draw(st.booleans()):
            shape[0:0], stride[0:0] = [True], [0]
        else:
            seq, i = draw(st.sampled_from(spots))
            seq[i] = bool(seq[i])
    elif fault == "view_bool_offset":
        view[4] = False
    elif fault == "view_float_offset":
        view[4] = float(offset)
    elif fault == "view_misaligned":  # within the blob, but not at a multiple of the element size
        view[4] = offset + draw(st.integers(1, size - 1))
    elif fault == "view_past_blob":  # aligned, its last element (or, without elements, its start) past the end
        view[4] = (max(0, blob - _extent(shape, stride, size)) // size + 1) * size
    else:  # view_longer_than_blob: elements in every dimension, one of which reaches past the blob's end
        shape[:] = [n or 1 for n in shape]
        if not any(stride):
            shape[0:0], stride[0:0] = [2], [blob // size + 1]
        i = next(i for i, s in enumerate(stride) if s)
        while offset + _extent(shape, stride, size) <= blob:
            shape[i] += 1


def file_of(table: dict[str, Any], views: list[list[Any]], data: bytes, header_crc: bool) -> bytes:
    """A ckptstream file: the table, a flat structure of its tensors (t0, ...) and the views (v0,
    ...), and, with ``header_crc``, the header's own consistent CRC-32C."""
    nodes = [[n, {"tensor": n}] for n in table if n != BLOB] + [[f"v{i}", {"view": v}] for i, v in enumerate(views)]
    meta = {"ckptstream.format": "1", "ckptstream.structure": json.dumps({"dict": nodes})}
    if header_crc:
        meta["ckptstream.header_crc32c"] = "0" * 8
    raw = bytearray(frame(encode_header({"__metadata__": meta, **table}), data))
    if header_crc:
        (n,) = struct.unpack("<Q", raw[:8])
        at = raw.index(b'"ckptstream.header_crc32c":"') + len('"ckptstream.header_crc32c":"')
        raw[at : at + 8] = f"{crc_of(bytes(raw[: 8 + n])):08x}".encode()
    return bytes(raw)


@FAST
@given(valid_and_faulty(), st.integers(0, 2**32 - 1), st.booleans())
def test_invalid_numbers_are_rejected(tmp_path_factory: pytest.TempPathFactory,
                                      case: tuple[str, dict[str, Any], list[list[Any]], dict[str, Any],
                                                  list[list[Any]], int], seed: int, header_crc: bool) -> None:
    fault, table, views, bad_table, bad_views, _ = case
    directory = tmp_path_factory.getbasetemp()
    data = random.Random(seed).randbytes(max((e["data_offsets"][1] for e in table.values()), default=0))
    good, bad = directory / "valid.safetensors", directory / "faulty.safetensors"
    good.write_bytes(file_of(table, views, data, header_crc))
    bad.write_bytes(file_of(bad_table, bad_views, data, header_crc))
    loaded = ckptstream.load(good)
    begin, end = table[BLOB]["data_offsets"]
    for i, view in enumerate(views):
        assert element_bytes(loaded[f"v{i}"]) == _view_bytes(data[begin:end], view), view
    for name in table.keys() - {BLOB}:
        begin, end = table[name]["data_offsets"]
        assert element_bytes(loaded[name]) == data[begin:end], name
    check_rejected(str(bad), in_table=fault in TABLE_FAULTS)
    for t in loaded.values():  # the valid file's tensors, poisoned, as load_into's targets
        torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0xAB)
    with pytest.raises(CorruptCheckpointError):
        ckptstream.load_into(loaded, bad)
    assert all(bool((torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()) == 0xAB).all())
               for t in loaded.values()), "load_into wrote into a target"

