"""load_into: fills live tensors in place (same storage, their own devices); every mismatch is
reported at once before a byte is written; strict=False loads what both sides have and warns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptstream
from ckptstream._header import DTYPE_NAMES
from helpers import WRITABLE_EDGE_CASES, as_bytes, assert_bytes_equal, is_poisoned, poisoned_like, random_tensor

STORABLE_WRITABLE_CASES = [c for c in WRITABLE_EDGE_CASES if c.dtype in DTYPE_NAMES]


def test_fills_tensors_in_place(device: torch.device, tmp_path: Path) -> None:
    state: dict[Any, Any] = {
        "w": random_tensor((4, 5), device=device),
        "nested": {"b": random_tensor(5, torch.bfloat16, device), 3: [random_tensor(3, torch.int64, device)]},
        "step": 7, "name": "run ü", "lr": 0.5, "flags": (True, None),
    }  # fmt: skip
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    target: dict[str, Any] = {
        "w": poisoned_like(state["w"]),
        "nested": {"b": poisoned_like(state["nested"]["b"]), 3: [poisoned_like(state["nested"][3][0])]},
        "step": 0, "name": "", "lr": 0.0, "flags": (False, None),
    }  # fmt: skip
    ptrs = [target["w"].data_ptr(), target["nested"]["b"].data_ptr(), target["nested"][3][0].data_ptr()]
    out = ckptstream.load_into(target, path)
    assert out["w"] is target["w"]
    assert out["nested"]["b"] is target["nested"]["b"]
    assert out["nested"][3][0] is target["nested"][3][0]
    assert [target["w"].data_ptr(), target["nested"]["b"].data_ptr(), target["nested"][3][0].data_ptr()] == ptrs
    assert_bytes_equal(target["w"], state["w"])
    assert_bytes_equal(target["nested"]["b"], state["nested"]["b"])
    assert_bytes_equal(target["nested"][3][0], state["nested"][3][0])
    assert (out["step"], out["name"], out["lr"], out["flags"]) == (7, "run ü", 0.5, (True, None))  # from the file
    assert target["step"] == 0  # the given structure itself is not modified


@pytest.mark.parametrize("buffer_size", [None, 513])
def test_non_contiguous_targets(device: torch.device, tmp_path: Path, buffer_size: int | None) -> None:
    """Views into larger storages are filled in place; the bytes around them stay as they were."""
    sources = {c.name: c.source("cpu") for c in STORABLE_WRITABLE_CASES}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(sources, path)
    bases, views = {}, {}
    for c in STORABLE_WRITABLE_CASES:
        bases[c.name], views[c.name] = c.destination(device)
    ckptstream.load_into(views, path, buffer_size=buffer_size, num_buffers=2)
    for c in STORABLE_WRITABLE_CASES:
        assert_bytes_equal(views[c.name], sources[c.name])
        assert_bytes_equal(bases[c.name], c.expected_base(sources[c.name].to(device)))


def test_parameters_requiring_grad(device: torch.device, tmp_path: Path) -> None:
    state = {"w": random_tensor((6, 3), device=device), "t": random_tensor((3, 6), device=device)}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    w = nn.Parameter(poisoned_like(state["w"]))
    t = nn.Parameter(poisoned_like(state["w"]).t())  # a non-contiguous parameter
    ptrs = (w.data_ptr(), t.data_ptr())
    out = ckptstream.load_into({"w": w, "t": t}, tmp_path / "ckpt.safetensors")
    assert out["w"] is w
    assert out["t"] is t
    assert (w.data_ptr(), t.data_ptr()) == ptrs
    assert w.requires_grad
    assert t.requires_grad
    assert w.grad is None
    assert w.is_leaf
    assert_bytes_equal(w.detach(), state["w"])
    assert_bytes_equal(t.detach(), state["t"])


def test_mismatches_all_reported_before_any_write(tmp_path: Path) -> None:
    ckptstream.save({"a": random_tensor(3), "b": random_tensor(4), "c": random_tensor((2, 2)),
                     "d": random_tensor(5, torch.int64), "n": 1}, tmp_path / "ckpt.safetensors")  # fmt: skip
    target = {
        "a": poisoned_like(torch.empty(3)),
        "c": poisoned_like(torch.empty(2, 3)),
        "d": poisoned_like(torch.empty(5)),
        "extra": poisoned_like(torch.empty(2)),
        "n": poisoned_like(torch.empty(1)),
    }
    with pytest.raises(ckptstream.StateMismatchError) as e:
        ckptstream.load_into(target, tmp_path / "ckpt.safetensors")
    message = str(e.value)
    assert isinstance(e.value, ValueError)
    assert str(tmp_path / "ckpt.safetensors") in message
    for fragment in ("missing from the file: extra", "missing from the file: n", "in the file but not in the state: b",
                     "c: the file has torch.float32 [2, 2], the state torch.float32 [2, 3]",
                     "d: the file has torch.int64 [5], the state torch.float32 [5]"):  # fmt: skip
        assert fragment in message
    assert all(is_poisoned(t) for t in target.values())  # "a" matched, but nothing was written


def test_not_strict_loads_the_intersection_and_warns(tmp_path: Path) -> None:
    state: dict[str, Any] = {"a": random_tensor(3), "b": random_tensor(4), "step": 5, "deep": {"c": random_tensor(2)}}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    target: dict[str, Any] = {"a": poisoned_like(state["a"]), "extra": poisoned_like(torch.empty(2)),
                              "deep": {"c": None}}
    with pytest.warns(ckptstream.StateMismatchWarning, match="skipped 1 missing key") as record:
        out = ckptstream.load_into(target, tmp_path / "ckpt.safetensors", strict=False)
    (warning,) = record
    assert isinstance(warning.message, ckptstream.StateMismatchWarning)
    assert (warning.message.missing, warning.message.unexpected) == (["extra"], ["b", "deep.c"])
    assert warning.filename == __file__  # points at the caller
    assert_bytes_equal(target["a"], state["a"])
    assert is_poisoned(target["extra"])
    assert out == {"a": target["a"], "b": None, "step": 5, "deep": {"c": None}}


def test_not_strict_still_rejects_shape_and_dtype_mismatches(tmp_path: Path) -> None:
    ckptstream.save({"a": random_tensor(3), "b": random_tensor(4)}, tmp_path / "ckpt.safetensors")
    target = {"a": poisoned_like(torch.empty(3)), "b": poisoned_like(torch.empty(4, dtype=torch.float64))}
    with pytest.raises(ckptstream.StateMismatchError, match=r"b: the file has torch\.float32"):
        ckptstream.load_into(target, tmp_path / "ckpt.safetensors", strict=False)
    assert is_poisoned(target["a"])


def test_shared_tensors_in_the_file_into_separate_targets(device: torch.device, tmp_path: Path) -> None:
    w, base = random_tensor((4, 4)), random_tensor(100)
    state = {"emb": w, "head": w, "whole": base, "half": base[:50], "t": base.view(10, 10).t()}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)

    separate = {k: poisoned_like(v).to(device) for k, v in state.items()}
    ckptstream.load_into(separate, path)
    for k, v in state.items():
        assert_bytes_equal(separate[k], v)

    # a flat state stores overlapping views apart (each key a tensor name): targets that overlap
    # are refused before a byte is written, but the same tensor twice (tied weights) is fine
    w2, base2 = poisoned_like(w).to(device), poisoned_like(base).to(device)
    shared = {"emb": w2, "head": w2, "whole": base2, "half": base2[:50], "t": base2.view(10, 10).t()}
    with pytest.raises(ckptstream.StateMismatchError, match="whole and half overlap in memory"):
        ckptstream.load_into(shared, path)
    assert as_bytes(base2) == as_bytes(poisoned_like(base))
    tied = {k: v for k, v in shared.items() if k in ("emb", "head")} | {k: separate[k] for k in ("whole", "half", "t")}
    out = ckptstream.load_into(tied, path)
    assert out["emb"] is out["head"] is w2
    assert_bytes_equal(w2, w)

    # a nested state stores them as views of one blob: overlapping targets are filled consistently
    nested_path = tmp_path / "nested.safetensors"
    ckptstream.save({"m": state}, nested_path)
    base3 = poisoned_like(base).to(device)
    nested = {"emb": w2, "head": w2, "whole": base3, "half": base3[:50], "t": base3.view(10, 10).t()}
    ckptstream.load_into({"m": nested}, nested_path)
    for k, v in state.items():
        assert_bytes_equal(nested[k], v)


def test_tied_module_weights(tmp_path: Path) -> None:
    def tied() -> Any:  # an nn.Sequential, indexed by position below
        model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11, bias=False))
        model[1].weight = model[0].weight
        return model

    source, model = tied(), tied()
    ckptstream.save(source.state_dict(), tmp_path / "ckpt.safetensors")
    before = model[0].weight.data_ptr()
    ckptstream.load_into(model.state_dict(keep_vars=True), tmp_path / "ckpt.safetensors")
    assert model[0].weight.data_ptr() == before
    assert model[1].weight is model[0].weight
    assert_bytes_equal(model[0].weight.detach(), source[0].weight.detach())


@pytest.mark.parametrize("keep", ["header_only", "half_the_header", "one_byte_short", "half_the_data", "seven_bytes"])
def test_truncated_file_never_writes_into_targets(keep: str, tmp_path: Path) -> None:
    state = {"a": random_tensor(3000), "b": random_tensor((40, 30), torch.float16)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    size = os.path.getsize(path)
    data_start = size - 3000 * 4 - 40 * 30 * 2
    length = {"header_only": data_start, "half_the_header": data_start // 2, "one_byte_short": size - 1,
              "half_the_data": (data_start + size) // 2, "seven_bytes": 7}[keep]  # fmt: skip
    os.truncate(path, length)
    target = {k: poisoned_like(v) for k, v in state.items()}
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"truncated|too short"):
        ckptstream.load_into(target, path)
    assert all(is_poisoned(t) for t in target.values())


def test_without_checksums(tmp_path: Path) -> None:
    state = {"a": random_tensor(10), "b": random_tensor(3, torch.int16)}
    ckptstream.save(state, tmp_path / "ckpt.safetensors")
    target = {k: poisoned_like(v) for k, v in state.items()}
    ckptstream.load_into(target, tmp_path / "ckpt.safetensors", checksum=False)
    for k, v in state.items():
        assert_bytes_equal(target[k], v)


@pytest.mark.parametrize("bad", ["expanded", "overlapping_strides", "sparse"])
def test_a_target_that_cannot_be_written_is_refused_before_any_byte(tmp_path: Path, bad: str) -> None:
    """Every destination is checked first: a target the file's bytes cannot land in is named in a
    StateMismatchError and no other target has changed (0.1.0 filled some, then failed in torch)."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"a": random_tensor((64, 64)), "b": random_tensor((4, 4))}, path, buffer_size=4096)
    a = poisoned_like(random_tensor((64, 64)))
    b = {"expanded": torch.zeros(4).expand(4, 4),
         "overlapping_strides": torch.zeros(10).as_strided((4, 4), (1, 1)),
         "sparse": torch.zeros(4, 4).to_sparse()}[bad]
    refusal = ckptstream.UnsupportedTypeError if bad == "sparse" else ckptstream.StateMismatchError  # see walk
    with pytest.raises(refusal, match=r"^b|\n  b"):
        ckptstream.load_into({"a": a, "b": b}, path)
    assert is_poisoned(a)


def test_strict_load_into_takes_tied_targets_the_file_stores_once(tmp_path: Path) -> None:
    """save_pretrained drops lm_head.weight, which is transformer.wte.weight: a strict load_into
    of the model's state_dict (which has both keys, one tensor) is satisfied by the one stored."""
    wte, bias = random_tensor((11, 4)), random_tensor(11)
    path = tmp_path / "model.safetensors"
    ckptstream.save({"transformer.wte.weight": wte, "lm_head.bias": bias}, path)
    weight = poisoned_like(wte)
    target = {"transformer.wte.weight": weight, "lm_head.weight": weight, "lm_head.bias": poisoned_like(bias)}
    ckptstream.load_into(target, path)  # strict by default
    assert_bytes_equal(target["lm_head.weight"], wte)
    other = {"transformer.wte.weight": poisoned_like(wte), "lm_head.weight": poisoned_like(wte),
             "lm_head.bias": poisoned_like(bias)}
    with pytest.raises(ckptstream.StateMismatchError, match=r"missing from the file: lm_head\.weight"):
        ckptstream.load_into(other, path)  # a separate tensor is still missing
