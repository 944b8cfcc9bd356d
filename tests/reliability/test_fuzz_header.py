"""Fuzzing the header codec and the open/parse/load path (_header.decode, ckptstream.open and
every public reader): random bytes, random headers built to pass the early checks, and mutations of
real files. Whatever the input, only CkptStreamError subclasses come out, nothing is allocated
beyond the file's size, and each call returns within a second (fuzzutil.check_file).

The examples are derandomized so CI is reproducible; the `slow` test explores further with
fresh randomness. atheris, where it is installed, fuzzes the same property with coverage
guidance in a child process.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzzutil import check_file, encode_header, frame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relutil import run_child, small_state

import ckptstream
from ckptstream._header import DTYPES

FAST = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
DEEP = settings(max_examples=5000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

# --- building blocks ----------------------------------------------------------------------------

HUGE = [2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
ints = st.one_of(st.integers(-3, 40), st.sampled_from(HUGE), st.integers(-(2**70), 2**70))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=6), st.sampled_from(list(DTYPES)))  # fmt: skip
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
dims = st.lists(st.one_of(st.integers(0, 6), st.sampled_from(HUGE)), max_size=4)


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
    for i, kwargs in enumerate([{"checksum": False}, {"checksum": True}]):
        path = directory / f"seed{i}.safetensors"
        ckptstream.save(small_state(i), path, metadata={"k": "v"}, **kwargs)
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
