"""save / load / verify / read_metadata: training states come back equal in every leaf and type,
tensors byte for byte and sharing storage as they did; bad input fails before any file exists;
a failed save leaves the old file as it was."""

from __future__ import annotations

import collections
import errno
import itertools
import math
import os
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptstream
from ckptstream import Settings
from ckptstream._engine.tensor_bytes import flat_bytes
from ckptstream._format import header as _header
from ckptstream._format.header import DTYPE_NAMES
from ckptstream._storage import fileio, publish
from tests.helpers import (
    EDGE_CASES,
    FLOAT4,
    Resources,
    assert_bytes_equal,
    buffers,
    header_of,
    needs_float4,
    random_bytes,
    random_tensor,
)
from tests.storages import Place

KiB = 1 << 10
STORABLE_EDGE_CASES = [c for c in EDGE_CASES if c.dtype in DTYPE_NAMES]


def on(t: torch.Tensor, device: torch.device | str) -> bool:
    want = torch.device(device)
    return t.device.type == want.type and want.index in (None, t.device.index)


def assert_same(actual: Any, expected: Any, device: torch.device | str | None = None, where: str = "state") -> None:
    """Equal in every leaf and type: container types, key order and key types, leaf types and
    values (floats bit for bit), tensors byte for byte with dtype and shape, on ``device`` (None:
    on the expected tensor's device; "any": anywhere)."""
    if isinstance(expected, torch.Tensor):
        assert type(actual) is torch.Tensor, f"{where}: {type(actual).__name__}"
        assert device == "any" or on(actual, device or expected.device), f"{where}: on {actual.device}"
        assert_bytes_equal(actual, expected)
        return
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], f"{where}: keys differ"
        for k in expected:
            assert_same(actual[k], expected[k], device, f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, device, f"{where}.{i}")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), where
    elif isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# --- a real training state ------------------------------------------------------------------

VOCAB, DIM = 61, 24


class Block(nn.Module):
    """A small pre-norm transformer-style block whose output head is tied to its embedding."""

    seen: torch.Tensor  # a buffer: steps taken

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm1 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm2 = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.mlp(self.norm1(x))
        return self.head(self.norm2(x))


def make_training(device: torch.device | str) -> tuple[Block, torch.optim.AdamW]:
    model = Block().to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    return model, opt


def train(model: Block, opt: torch.optim.AdamW, steps: int) -> None:
    """Steps on batches drawn from the global RNG (so that resuming needs the RNG state)."""
    device = model.emb.weight.device
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 17)).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.seen += 1


def training_state(model: Block, opt: torch.optim.AdamW) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 3,
        "rng": torch.get_rng_state(),
        "loader": {"epoch": 1, "batch": 37, "sampler": {"seed": 1234, "order": (4, 0, 3)}, "exhausted": False},
    }


def parameters_bytes(model: nn.Module) -> list[bytes]:
    return [p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for p in model.parameters()]


def test_training_state_round_trip(device: torch.device, place: Place) -> None:
    model, opt = make_training(device)
    train(model, opt, 3)
    state = training_state(model, opt)
    assert isinstance(state["optim"]["state"][0]["exp_avg"], torch.Tensor)  # the optimizer state exists
    path = place.path("ckpt.safetensors")
    ckptstream.save(state, path)

    for where in (str(device), "cpu"):
        loaded = ckptstream.load(path, device=where)
        assert_same(loaded, state, device=where)
        assert loaded["model"]["emb.weight"] is loaded["model"]["head.weight"]  # tied: one tensor
    names = set(place.header(path)) - {"__metadata__"}
    assert "model.emb.weight" in names
    assert "model.head.weight" not in names


def test_resume_from_load_is_bit_exact(tmp_path: Path) -> None:
    model, opt = make_training("cpu")
    train(model, opt, 3)
    ckptstream.save(training_state(model, opt), tmp_path / "ckpt.safetensors")
    train(model, opt, 2)

    loaded = ckptstream.load(tmp_path / "ckpt.safetensors")
    model2, opt2 = make_training("cpu")
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    torch.set_rng_state(loaded["rng"])
    train(model2, opt2, 2)
    assert parameters_bytes(model2) == parameters_bytes(model)
    assert model2.seen.item() == model.seen.item() == 5


def test_load_into_a_live_training_state(device: torch.device, tmp_path: Path) -> None:
    model, opt = make_training(device)
    train(model, opt, 3)
    state = training_state(model, opt)
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    saved = ckptstream.load(tmp_path / "ckpt.safetensors")  # a copy; training goes on in place
    train(model, opt, 2)

    model2, opt2 = make_training(device)
    train(model2, opt2, 1)  # creates the optimizer state that load_into fills
    ptrs = [p.data_ptr() for p in model2.parameters()]
    rng = torch.empty_like(torch.get_rng_state())
    target: dict[str, Any] = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0, "rng": rng,
                              "loader": None}
    loaded = ckptstream.load_into(target, tmp_path / "ckpt.safetensors")
    assert [p.data_ptr() for p in model2.parameters()] == ptrs
    assert_same(loaded, saved, device="any")  # the file's leaves, in the given tensors
    assert loaded["rng"] is rng
    assert loaded["model"]["emb.weight"] is target["model"]["emb.weight"]
    assert_same(opt2.state_dict()["state"], saved["optim"]["state"], device="any")

    torch.set_rng_state(rng)
    train(model2, opt2, 2)
    if device.type == "cpu":
        assert parameters_bytes(model2) == parameters_bytes(model)  # resumed bit for bit
    else:  # CUDA kernels may reduce in another order from run to run
        for p2, p in zip(model2.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p2, p)


# --- structure and leaf types ---------------------------------------------------------------


def mixed_state() -> dict[str, Any]:
    t = random_tensor((3, 4))
    return collections.OrderedDict([
        ("zulu", 1),
        ("alpha", {3: "three", "3": 3.0, 0: [True, False, None], -7: (), "": "empty key", "a.b": 2}),
        ("ints", [0, -1, 2**63 + 5, -(2**70), True, 1, 1.0]),
        ("floats", (0.5, -0.0, 0.0, 1e300, 5e-324, math.inf, -math.inf, math.nan, 1 / 3)),
        ("strs", ["", "héllo wörld ✓ 漢字 🚀", 'quote " backslash \\ newline \n tab \t', "\x00", "nan",
                  '{"tensor": "zulu"}', '{"dict": []}']),
        ("empty", [{}, [], (), collections.OrderedDict(), ((),), [[]]]),
        ("tensors", {"t": t, "nested": [(random_tensor(5, torch.int64),)], "none": None}),
        ("od", collections.OrderedDict([("b", 1), (2, collections.OrderedDict()), ("a", {"x": 1})])),
    ])  # fmt: skip


ROOTS: list[tuple[str, Callable[[], Any]]] = [
    ("mixed", mixed_state),
    ("empty_dict", dict),
    ("empty_list", list),
    ("tuple", lambda: (1, random_tensor(3), "x")),
    ("list", lambda: [random_tensor(2, torch.bfloat16), [None]]),
    ("bare_tensor", lambda: random_tensor((2, 3))),
    ("bare_int", lambda: 7),
    ("bare_none", lambda: None),
    ("bare_str", lambda: "ü"),
    ("int_keys", lambda: {2: random_tensor(2), 1: random_tensor(3), "1": random_tensor(4)}),
    ("colliding_names", lambda: {"a.b": random_tensor(2), "a": {"b": random_tensor(3)}, "a.b~1": random_tensor(4)}),
    ("reserved_name", lambda: {"__metadata__": random_tensor(3), "x": random_tensor(1)}),
]


@pytest.mark.parametrize("make", [m for _, m in ROOTS], ids=[n for n, _ in ROOTS])
def test_structure_round_trip(make: Callable[[], Any], place: Place) -> None:
    state, path = make(), place.path("ckpt.safetensors")
    ckptstream.save(state, path)
    ckptstream.verify(path)
    assert_same(ckptstream.load(path), state)


def test_dict_order_differs_from_file_order(tmp_path: Path) -> None:
    """The file lays tensors out by dtype and name; the state keeps its own key order."""
    state = {"z": random_tensor(3, torch.int8), "m": random_tensor(3, torch.float64), "a": random_tensor(3)}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    assert list(ckptstream.load(tmp_path / "ckpt.safetensors")) == ["z", "m", "a"]


# --- tensors: the edge-case table, small buffers, many tensors -------------------------------


@pytest.mark.parametrize("buffer_size", [None, 513, 4096])
def test_edge_case_tensors_round_trip(device: torch.device, place: Place, buffer_size: int | None) -> None:
    """Every storable edge case, plus tensors that span many chunks of a small buffer; checksums on."""
    state: dict[str, Any] = {c.name: c.source(device) for c in STORABLE_EDGE_CASES}
    state["spans_chunks"] = random_tensor(3001, torch.float32, device)
    state["spans_chunks_transposed"] = random_tensor((70, 53), torch.bfloat16, device).t()
    path = place.path("ckpt.safetensors")
    ckptstream.save(state, path, settings=buffers(buffer_size, 2))
    ckptstream.verify(path)
    for where in (device, "cpu"):
        loaded = ckptstream.load(path, device=where, settings=buffers(buffer_size, 3))
        assert list(loaded) == list(state)
        for name, t in loaded.items():
            assert t.is_contiguous(), name
            assert on(t, where), name
            assert_bytes_equal(t, state[name])


@needs_float4
@pytest.mark.parametrize("buffer_size", [None, 4096])
def test_float4_views_and_background_saves(device: torch.device, tmp_path: Path, buffer_size: int | None) -> None:
    """float4 tensors move as bytes (torch 2.8 cannot copy them): a transposed one saved and
    loaded into a transposed target, and every save_async mode."""
    assert FLOAT4 is not None
    state = {"t": random_tensor((64, 90), FLOAT4, device).t(), "c": random_tensor((5, 3), FLOAT4, device)}
    path = tmp_path / "f4.safetensors"
    ckptstream.save(state, path, settings=buffers(buffer_size))
    targets = {"t": torch.empty(64, 90, dtype=FLOAT4, device=device).t(), "c": torch.empty(5, 3, dtype=FLOAT4,
                                                                                           device=device)}
    ckptstream.load_into(targets, path, settings=buffers(buffer_size))
    for mode in ("device", "lazy", "host"):
        ckptstream.save_async(state, tmp_path / f"{mode}.safetensors", mode=mode,
                              settings=buffers(buffer_size)).result()
        loaded = ckptstream.load(tmp_path / f"{mode}.safetensors", device=device)
        for name, t in state.items():
            assert_bytes_equal(loaded[name], t)
            assert_bytes_equal(targets[name], t)


def test_small_buffers_from_settings(tmp_path: Path) -> None:
    state = {"a": random_tensor(5000), "b": random_tensor((33, 65), torch.float16).t(), "c": random_tensor(3)}
    with ckptstream.settings(buffer_size=4096, num_buffers=2):
        ckptstream.save(state, tmp_path / "ckpt.safetensors")
        ckptstream.verify(tmp_path / "ckpt.safetensors")
        assert_same(ckptstream.load(tmp_path / "ckpt.safetensors"), state)


@pytest.mark.timeout(60)  # work per tensor is constant: a quadratic step takes minutes here
def test_twenty_thousand_small_tensors(tmp_path: Path) -> None:
    n = 20_000
    data = random_bytes(n * KiB)
    state = {f"layer{i}.w": data[i * KiB : (i + 1) * KiB].view(torch.float32).clone() for i in range(n)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    data_start, _ = header_of(path)
    assert data_start % 4096 == 0
    assert os.path.getsize(path) == data_start + n * KiB
    loaded = ckptstream.load(path)
    assert list(loaded) == list(state)
    assert_bytes_equal(torch.cat(list(loaded.values())).view(torch.uint8), data)
    for t in loaded.values():
        t.zero_()
    ckptstream.load_into(loaded, path)
    assert_bytes_equal(torch.cat(list(loaded.values())).view(torch.uint8), data)


# --- shared storage -------------------------------------------------------------------------


def test_same_tensor_twice_is_one_tensor(device: torch.device, tmp_path: Path) -> None:
    w = random_tensor((8, 4), device=device)
    state = {"emb": w, "head": w, "deep": [{"again": w}], "other": random_tensor(3, device=device)}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    out = ckptstream.load(tmp_path / "ckpt.safetensors", device=device)
    assert_same(out, state)
    assert out["emb"] is out["head"] is out["deep"][0]["again"]
    assert sorted(set(header_of(tmp_path / "ckpt.safetensors")[1]) - {"__metadata__"}) == ["emb", "other"]


def overlapping_views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "whole": base, "head": base[:60], "tail": base[40:], "again": base,
        "t": base.view(10, 10).t(), "as_int": base.view(torch.int32)[10:20], "expanded": base[5:6].expand(4, 3),
    }  # fmt: skip


def test_overlapping_views_come_back_sharing_storage(device: torch.device, tmp_path: Path) -> None:
    base = random_tensor(100, device=device)
    views = overlapping_views(base)
    state = {"views": views, "step": 1}  # nested: a flat dict keeps every key a tensor name (below)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    data_start, _ = header_of(path)
    assert os.path.getsize(path) == data_start + 100 * 4  # the storage once, not each view
    out = ckptstream.load(path, device=device)
    assert_same(out, state)
    loaded = out["views"]
    assert loaded["whole"] is loaded["again"]
    assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1
    for name, t in views.items():
        assert loaded[name].stride() == t.stride(), name
        assert loaded[name].data_ptr() - loaded["whole"].data_ptr() == t.data_ptr() - base.data_ptr(), name
    loaded["whole"][50] = 123.0  # writes through one show through the others
    assert loaded["head"][50].item() == loaded["tail"][10].item() == loaded["t"][0, 5].item() == 123.0
    loaded["tail"][-1] = -5.0
    assert loaded["whole"][99].item() == -5.0


def test_flat_state_of_overlapping_views_keeps_every_key_a_tensor_name(device: torch.device, tmp_path: Path) -> None:
    """A flat dict is a drop-in safetensors file: every key a tensor of the table, overlapping
    views each stored as its own bytes (the same tensor twice still once)."""
    base = random_tensor(100, device=device)
    state = overlapping_views(base)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    _, header = header_of(path)
    assert sorted(set(header) - {"__metadata__"}) == sorted(set(state) - {"again"})
    out = ckptstream.load(path, device=device)
    assert_same(out, state)
    assert out["whole"] is out["again"]
    from safetensors.torch import load_file

    theirs = load_file(path)
    for name in set(state) - {"again"}:
        assert_bytes_equal(theirs[name], state[name].cpu())


def test_tied_parameters_of_a_module(tmp_path: Path) -> None:
    model = Block()
    ckptstream.save(dict(model.named_parameters()), tmp_path / "ckpt.safetensors")
    out = ckptstream.load(tmp_path / "ckpt.safetensors")
    assert "head.weight" not in out  # named_parameters lists a tied parameter once
    sd = model.state_dict(keep_vars=True)
    ckptstream.save(sd, tmp_path / "sd.safetensors")
    out = ckptstream.load(tmp_path / "sd.safetensors")
    assert out["emb.weight"] is out["head.weight"]
    assert_bytes_equal(out["head.weight"], model.emb.weight)


def test_small_view_of_a_big_storage_writes_only_its_bytes(device: torch.device, tmp_path: Path) -> None:
    big = random_tensor(1 << 20, device=device)
    state = {"v": big[1000:1010], "w": big.view(1024, 1024)[3:5, 7:9], "far": big[-3:]}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    data_start, _ = header_of(path)
    assert os.path.getsize(path) == data_start + (10 + 4 + 3) * 4
    assert_same(ckptstream.load(path, device=device), state)


def test_lazy_conjugate_and_negative_views_store_their_values(tmp_path: Path) -> None:
    z = random_tensor(6, torch.complex64)
    state = {"z": z, "conj": z.conj(), "neg_imag": z.conj().imag, "alone": random_tensor(3, torch.complex64).conj()}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    out = ckptstream.load(tmp_path / "ckpt.safetensors")
    for name, t in state.items():
        assert not out[name].is_conj()
        assert not out[name].is_neg()
        assert_bytes_equal(out[name], t.resolve_conj().resolve_neg())


# --- what cannot be stored ------------------------------------------------------------------


class Point(NamedTuple):
    x: int
    y: int


class TaggedTensor(torch.Tensor):
    pass


UNSUPPORTED: list[tuple[str, Callable[[], Any], str]] = [
    ("object", object, "object"),
    ("numpy_float", lambda: np.float32(1.5), "float32"),
    ("numpy_int", lambda: np.int64(3), "int64"),
    ("numpy_array", lambda: np.zeros(3), "ndarray"),
    ("set", lambda: {1, 2}, "set"),
    ("frozenset", lambda: frozenset(), "frozenset"),
    ("bytes", lambda: b"raw", "bytes"),
    ("complex", lambda: 1 + 2j, "complex"),
    ("namedtuple", lambda: Point(1, 2), "Point"),
    ("defaultdict", lambda: collections.defaultdict(int), "defaultdict"),
    ("function", lambda: len, "builtin_function_or_method"),
    ("dtype", lambda: torch.float32, "dtype"),
    ("tensor_subclass", lambda: torch.ones(2).as_subclass(TaggedTensor), "TaggedTensor"),
    ("complex128", lambda: torch.ones(2, dtype=torch.complex128), "complex128"),
    ("sparse", lambda: torch.eye(3).to_sparse(), "sparse"),
    ("meta", lambda: torch.empty(3, device="meta"), "meta"),
    ("tuple_key", lambda: {(1, 2): 0}, "tuple"),
    ("float_key", lambda: {1.5: 0}, "float"),
    ("bool_key", lambda: {True: 0}, "bool"),
    ("none_key", lambda: {None: 0}, "NoneType"),
]


@pytest.mark.parametrize(("make", "type_name"), [(m, t) for _, m, t in UNSUPPORTED], ids=[n for n, _, _ in UNSUPPORTED])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "replacing"])
def test_unsupported_value_fails_before_any_file(make: Callable[[], Any], type_name: str, existing: bool,
                                                 tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    if existing:
        ckptstream.save({"w": random_tensor(10)}, path)
    before = path.read_bytes() if existing else None
    state = {"model": {"w": random_tensor(4)}, "extra": {"items": [1, make()]}}
    with pytest.raises(ckptstream.UnsupportedTypeError, match=type_name) as e:
        ckptstream.save(state, path)
    assert isinstance(e.value, TypeError)
    assert "extra.items.1" in str(e.value)
    assert os.listdir(tmp_path) == (["ckpt.safetensors"] if existing else [])
    if existing:
        assert path.read_bytes() == before


def test_state_containing_itself(tmp_path: Path) -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(ckptstream.UnsupportedTypeError, match="contains itself"):
        ckptstream.save({"x": loop}, tmp_path / "ckpt.safetensors")
    assert os.listdir(tmp_path) == []


def test_parameters_are_stored_as_tensors(tmp_path: Path) -> None:
    p = nn.Parameter(random_tensor(4))
    ckptstream.save({"p": p}, tmp_path / "ckpt.safetensors")
    out = ckptstream.load(tmp_path / "ckpt.safetensors")
    assert type(out["p"]) is torch.Tensor
    assert not out["p"].requires_grad
    assert_bytes_equal(out["p"], p.detach())


# --- metadata -------------------------------------------------------------------------------


def test_metadata_round_trip(tmp_path: Path) -> None:
    meta = {"run": "héllo 漢字", "": "", "long": "x" * 5000, "json": '{"a": [1, 2]}'}
    ckptstream.save({"w": random_tensor(3)}, tmp_path / "a.safetensors", metadata=meta)
    assert ckptstream.read_metadata(tmp_path / "a.safetensors") == meta
    ckptstream.save({"w": random_tensor(3)}, tmp_path / "b.safetensors")
    assert ckptstream.read_metadata(tmp_path / "b.safetensors") == {}
    _, header = header_of(tmp_path / "a.safetensors")
    assert header["__metadata__"]["ckptstream.format"] == "1"  # our own keys sit beside the user's


@pytest.mark.parametrize(("meta", "error", "fragment"), [
    ({"k": 1}, TypeError, "str to str"),
    ({"k": None}, TypeError, "str to str"),
    ({1: "v"}, TypeError, "str to str"),
    ({"ckptstream.format": "2"}, ValueError, "reserved"),
    ({"ckptstream.anything": "x"}, ValueError, "reserved"),
], ids=["int_value", "none_value", "int_key", "reserved_format", "reserved_prefix"])  # fmt: skip
def test_bad_metadata_fails_before_any_file(meta: dict[Any, Any], error: type[Exception], fragment: str,
                                            tmp_path: Path) -> None:
    with pytest.raises(error, match=fragment):
        ckptstream.save({"w": random_tensor(3)}, tmp_path / "ckpt.safetensors", metadata=meta)
    assert os.listdir(tmp_path) == []


def test_header_over_the_limit_fails_before_any_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that safetensors readers (and load) would refuse is never written."""
    monkeypatch.setattr(_header, "MAX_HEADER", 50_000)  # the real one is 100 MB
    ckptstream.save({"w": random_tensor(3), "notes": "x" * 40_000}, tmp_path / "ok.safetensors")
    with pytest.raises(ValueError, match="over the 50000-byte limit"):
        ckptstream.save({"w": random_tensor(3), "notes": "x" * 60_000}, tmp_path / "ckpt.safetensors")
    assert os.listdir(tmp_path) == ["ok.safetensors"]


# --- atomic publish -------------------------------------------------------------------------


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> itertools.count[int]:
    """Counts calls of ``fileio.<name>``."""
    calls = itertools.count()
    real = getattr(fileio, name)

    def counted(*args: Any) -> Any:
        next(calls)
        return real(*args)

    monkeypatch.setattr(fileio, name, counted)
    return calls


def fail_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, k: int, error: BaseException) -> None:
    """``owner.<name>`` raises ``error`` on its call number ``k`` (0-based), works otherwise."""
    calls = itertools.count()
    real = getattr(owner, name)

    def failing(*args: Any) -> Any:
        if next(calls) == k:
            raise error
        return real(*args)

    monkeypatch.setattr(owner, name, failing)


ERRORS: list[tuple[str, Callable[[], BaseException]]] = [
    ("ENOSPC", lambda: OSError(errno.ENOSPC, "No space left on device")),
    ("KeyboardInterrupt", KeyboardInterrupt),
]


@pytest.mark.parametrize("make_error", [e for _, e in ERRORS], ids=[n for n, _ in ERRORS])
@pytest.mark.parametrize("where", ["header", "first_chunk", "middle_chunk", "checksum_header", "fsync", "rename"])
def test_failed_save_keeps_the_old_file(where: str, make_error: Callable[[], BaseException], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"old": random_tensor(100)}, path)
    old = path.read_bytes()
    resources = Resources.snapshot()
    state = {"a": random_tensor(9000), "b": random_tensor((50, 40)).t(), "c": random_tensor(7, torch.int16)}
    options: dict[str, Any] = {"buffer_size": 4096, "num_buffers": 2}

    with monkeypatch.context() as m:  # how many writes a save of this state makes
        calls = count_calls(m, "pwrite_all")
        ckptstream.save(state, tmp_path / "probe.safetensors", settings=Settings(**options))
        writes = next(calls)
    (tmp_path / "probe.safetensors").unlink()
    assert writes >= 6

    error = make_error()
    if where == "fsync":
        fail_on_call(monkeypatch, fileio, "fsync", 0, error)
    elif where == "rename":
        fail_on_call(monkeypatch, os, "replace", 0, error)  # the rename that publishes the file
    else:
        k = {"header": 0, "first_chunk": 1, "middle_chunk": writes // 2, "checksum_header": writes - 1}[where]
        fail_on_call(monkeypatch, fileio, "pwrite_all", k, error)
    with pytest.raises(type(error)) as e:
        ckptstream.save(state, path, settings=Settings(**options))
    if e.value is not error:  # an OS error may come back naming the file (and the room needed), from the one injected
        assert isinstance(error, OSError)
        assert isinstance(e.value, OSError)
        causes = [e.value.__cause__]
        while causes[-1] is not None and causes[-1] is not error:
            causes.append(causes[-1].__cause__)
        assert causes[-1] is error
        assert e.value.errno == error.errno
        assert str(path) in str(e.value)
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]  # no temp left
    assert path.read_bytes() == old
    resources.assert_released()
    monkeypatch.undo()
    ckptstream.verify(path)
    ckptstream.save(state, path, settings=Settings(**options))  # and the next save works
    assert_same(ckptstream.load(path), state)


def test_stale_temps_of_dead_writers_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    this_host = os.path.basename(publish.temp_path_for(str(path))).rsplit("-", 2)[0]  # .<name><mark><host>
    other_file = os.path.basename(publish.temp_path_for(str(tmp_path / "other.safetensors"))).rsplit("-", 2)[0]
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        stale = tmp_path / f"{this_host}-{dead.pid}-0123456789ab"
        running = tmp_path / f"{this_host}-{live.pid}-0123456789ab"
        not_ours = tmp_path / f"{other_file}-{dead.pid}-0123456789ab"
        other_host = tmp_path / f".ckpt.safetensors{publish.TEMP_MARK}no-such-host.invalid-{dead.pid}-0123456789ab"
        for temp in (stale, running, not_ours, other_host):
            temp.write_bytes(b"partial")
        state = {"w": random_tensor(10)}
        ckptstream.save(state, path)
        assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (path, running, not_ours, other_host))
        assert_same(ckptstream.load(path), state)
    finally:
        live.kill()
        live.wait()


# --- paths and progress ---------------------------------------------------------------------


def test_paths_with_spaces_and_non_ascii(tmp_path: Path) -> None:
    directory = tmp_path / "dir with spaces ü"
    directory.mkdir()
    path = directory / "ckpt é 漢字 🚀.safetensors"
    state = {"w": random_tensor((3, 5)), "n": 1}
    ckptstream.save(state, path, metadata={"k": "v"})
    ckptstream.save(state, str(path), metadata={"k": "v"})  # and as a str, replacing it
    assert os.listdir(directory) == [path.name]
    ckptstream.verify(path)
    assert ckptstream.read_metadata(str(path)) == {"k": "v"}
    assert_same(ckptstream.load(path), state)
    target = {"w": torch.empty(3, 5), "n": 0}
    assert_same(ckptstream.load_into(target, path), state)


def test_missing_parent_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        ckptstream.save({"w": random_tensor(3)}, missing / "ckpt.safetensors")
    assert e.value.filename == str(missing)
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError) as e:
        ckptstream.load(tmp_path / "absent.safetensors")
    assert e.value.filename == str(tmp_path / "absent.safetensors")


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt.safetensors"
    state = {"w": random_tensor(5000)}
    ckptstream.save(state, path)
    ckptstream.load(path)
    assert capsys.readouterr() == ("", "")  # quiet by default
    ckptstream.save(state, path, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "save ckpt.safetensors" in err
    assert "100%" in err
    ckptstream.load(path, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "load ckpt.safetensors" in err
    assert "100%" in err


def test_contiguous_tensors_with_odd_strides_on_size_1_dimensions(device: torch.device, tmp_path: Path) -> None:
    # contiguous, yet their size-1 dimensions carry strides other than 1 (which a dtype view refuses)
    base = random_tensor((4, 4), torch.float32, device)
    state = {"one": base[:, 1][:1], "row": base[1:2, :].t()[:, :1], "col": base[:, 2:3][:1]}
    assert all(t.is_contiguous() for t in state.values())
    assert state["one"].stride() == (4,)
    assert_bytes_equal(flat_bytes(state["one"]).cpu().numpy().tobytes(), state["one"])  # the device path's byte view
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    for loaded in (ckptstream.load(path, device=device),
                   ckptstream.load_into({k: torch.empty_like(v) for k, v in state.items()}, path)):
        for key, t in state.items():
            assert_bytes_equal(loaded[key], t)
    odd = {"one": torch.zeros(4, 4, device=device)[:, 1][:1]}  # load_into such a view itself
    with pytest.warns(ckptstream.StateMismatchWarning, match="unexpected"):
        ckptstream.load_into(odd, tmp_path / "c.safetensors", strict=False)
    assert_bytes_equal(odd["one"], state["one"])
