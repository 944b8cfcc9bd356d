"""load_into: fills live tensors in place (same storage, their own devices); every mismatch is
reported at once before a byte is written; strict=False loads what both sides have and warns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptstream
from ckptstream import Settings
from ckptstream._checkpoint import blocks, load_into
from ckptstream._format.header import DTYPE_NAMES
from ckptstream._format.structure import KeyPath
from tests.helpers import (
    WRITABLE_EDGE_CASES,
    as_bytes,
    assert_bytes_equal,
    buffers,
    flip_last_byte,
    is_poisoned,
    poison,
    poisoned_like,
    random_tensor,
)
from tests.storages import Place

STORABLE_WRITABLE_CASES = [c for c in WRITABLE_EDGE_CASES if c.dtype in DTYPE_NAMES]


def test_fills_tensors_in_place(device: torch.device, place: Place) -> None:
    state: dict[Any, Any] = {
        "w": random_tensor((4, 5), device=device),
        "nested": {"b": random_tensor(5, torch.bfloat16, device), 3: [random_tensor(3, torch.int64, device)]},
        "step": 7, "name": "run ü", "lr": 0.5, "flags": (True, None),
    }  # fmt: skip
    path = place.path("ckpt.safetensors")
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


@pytest.mark.parametrize("buffer_size", [4096, 16 << 20], ids=["4k", "16m"])
def test_many_small_targets_are_gathered_and_filled_in_place(device: torch.device, tmp_path: Path,
                                                             buffer_size: int) -> None:
    """Small tensors go through a scratch run (on a GPU one copy call, in host memory one move
    each): every target (plain, Parameter, a view inside a larger storage, non-contiguous,
    large, of every dtype, 0-d, empty) keeps its memory and gets exact bytes; a corrupt byte is
    named by its tensor, and the gathered targets are left as they were."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64, torch.float8_e4m3fn]
    state: dict[str, Any] = {f"s{i}": random_tensor((i % 9 + 1, 3) if i % 3 else (i % 17 + 1,), dtypes[i % 7], device)
                             for i in range(2000)}
    state["zero_d"] = random_tensor((), torch.int32, device)
    state["empty"] = random_tensor((0, 4), torch.float32, device)
    state["p"] = nn.Parameter(random_tensor((300,), torch.float32, device))
    state["inside"] = random_tensor((77,), torch.float16, device)
    state["t"] = random_tensor((40, 30), torch.float16, device).t()  # non-contiguous: streamed on its own
    state["big"] = random_tensor((300_000,), torch.float32, device)
    path = tmp_path / "small.safetensors"
    ckptstream.save(state, path)
    targets = {k: poisoned_like(v) for k, v in state.items()}
    targets["p"] = nn.Parameter(poisoned_like(state["p"]))
    around = poisoned_like(torch.empty(100, dtype=torch.float16, device=device))
    targets["inside"] = around[11:88]  # contiguous, at an offset into a larger storage
    targets["t"] = poisoned_like(torch.empty(40, 30, dtype=torch.float16, device=device)).t()
    where = {k: v.data_ptr() for k, v in targets.items()}
    ckptstream.load_into(targets, path, settings=buffers(buffer_size))
    for k, v in state.items():
        assert targets[k].data_ptr() == where[k], k
        assert_bytes_equal(targets[k], v)
    assert is_poisoned(around[:11])  # the bytes around are untouched
    assert is_poisoned(around[88:])
    flip_last_byte(path, "s1234")
    with torch.no_grad():
        for v in targets.values():
            poison(v)
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"'s1234' fails its CRC-32C"):
        ckptstream.load_into(targets, path, settings=buffers(buffer_size))
    assert is_poisoned(targets["s1234"])
    assert is_poisoned(targets["s5"])
    assert_bytes_equal(targets["big"], state["big"])  # streamed straight in: the file's (sound) bytes


@pytest.mark.parametrize("with_run", [True, False], ids=["a_long_run", "short_runs_only"])
def test_small_host_tensors_gather_in_long_runs_and_others_stream_straight(tmp_path: Path, with_run: bool) -> None:
    """Small host tensors in a run of at least HOST_RUN back to back in the file go through
    scratch memory and are moved in once verified; those in shorter runs (between large ones)
    stream straight into their targets, as large ones do: after a failed checksum, the long
    run's targets keep their old bytes and the others hold the file's. Without a long run every
    tensor is one piece, checked in file order."""
    # the file orders tensors by element size, then dtype and name: as listed here
    state = {"a_big": random_tensor((40_000,)), "b_lone": random_tensor((33,)), "c_big": random_tensor((50_000,)),
             "d0": random_tensor((7, 3), torch.bfloat16), "d1": random_tensor((9,), torch.bfloat16),
             "d_big": random_tensor((60_000,), torch.bfloat16)}
    run = [f"e{i}" for i in range(blocks.HOST_RUN)] if with_run else []
    state.update({k: random_tensor((10 + i,), torch.int16) for i, k in enumerate(run)})
    path = tmp_path / "runs.safetensors"
    ckptstream.save(state, path)
    with ckptstream.open(path) as reader:
        assert [t.name for t in reader.header.tensors] == list(state)
    targets = {k: poisoned_like(v) for k, v in state.items()}
    ckptstream.load_into(targets, path)
    for k, v in state.items():
        assert_bytes_equal(targets[k], v)
    flip_last_byte(path, "c_big")
    with torch.no_grad():
        for v in targets.values():
            poison(v)
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"'c_big' fails its CRC-32C"):
        ckptstream.load_into(targets, path)
    for k in run:
        assert is_poisoned(targets[k]), k  # moved in only after the checks
    for k in ("a_big", "b_lone", "d0", "d1"):  # streamed straight: the file's (sound) bytes
        assert_bytes_equal(targets[k], state[k])
    ckptstream.save(state, path)
    flip_last_byte(path, "d1")
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"'d1' fails its CRC-32C"):
        ckptstream.load_into(targets, path)


@pytest.mark.parametrize("buffer_size", [None, 513])
def test_non_contiguous_targets(device: torch.device, place: Place, buffer_size: int | None) -> None:
    """Views into larger storages are filled in place; the bytes around them stay as they were."""
    sources = {c.name: c.source("cpu") for c in STORABLE_WRITABLE_CASES}
    path = place.path("ckpt.safetensors")
    ckptstream.save(sources, path)
    bases, views = {}, {}
    for c in STORABLE_WRITABLE_CASES:
        bases[c.name], views[c.name] = c.destination(device)
    ckptstream.load_into(views, path, settings=buffers(buffer_size, 2))
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


def test_shared_tensors_in_the_file_into_separate_targets(device: torch.device, place: Place) -> None:
    w, base = random_tensor((4, 4)), random_tensor(100)
    state = {"emb": w, "head": w, "whole": base, "half": base[:50], "t": base.view(10, 10).t()}
    path = place.path("ckpt.safetensors")
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
    nested_path = place.path("nested.safetensors")
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
def test_truncated_file_never_writes_into_targets(keep: str, place: Place) -> None:
    state = {"a": random_tensor(3000), "b": random_tensor((40, 30), torch.float16)}
    path = place.path("ckpt.safetensors")
    ckptstream.save(state, path)
    size = len(place.read_bytes(path))
    data_start = size - 3000 * 4 - 40 * 30 * 2
    length = {"header_only": data_start, "half_the_header": data_start // 2, "one_byte_short": size - 1,
              "half_the_data": (data_start + size) // 2, "seven_bytes": 7}[keep]  # fmt: skip
    place.truncate(path, length)
    target = {k: poisoned_like(v) for k, v in state.items()}
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"truncated|too short"):
        ckptstream.load_into(target, path)
    assert all(is_poisoned(t) for t in target.values())


def test_without_checksums(place: Place) -> None:
    state, path = {"a": random_tensor(10), "b": random_tensor(3, torch.int16)}, place.path("ckpt.safetensors")
    ckptstream.save(state, path)
    target = {k: poisoned_like(v) for k, v in state.items()}
    ckptstream.load_into(target, path, checksum=False)
    for k, v in state.items():
        assert_bytes_equal(target[k], v)


@pytest.mark.parametrize("bad", ["expanded", "overlapping_strides", "sparse"])
def test_a_target_that_cannot_be_written_is_refused_before_any_byte(tmp_path: Path, bad: str) -> None:
    """Every destination is checked first: a target the file's bytes cannot land in is named in a
    StateMismatchError and no other target has changed (0.1.0 filled some, then failed in torch)."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"a": random_tensor((64, 64)), "b": random_tensor((4, 4))}, path,
                    settings=Settings(buffer_size=4096))
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


# --- the short way through the destination checks --------------------------------------------


def _destination_cases() -> dict[str, torch.Tensor]:
    """Targets of every kind the checks tell apart, a plain contiguous CPU tensor first (so that
    what is learnt of its device, dtype and layout is in place for the meta tensor after it)."""
    base = random_tensor(40)
    return {
        "plain": random_tensor((3, 4)),
        "meta": torch.empty((3, 4), device="meta"),
        "sparse": torch.zeros(3, 4).to_sparse(),
        "offset_slice": base[5:15],
        "strided_slice": base[::4],
        "transposed": random_tensor((4, 5)).t(),
        "channels_last": random_tensor((2, 3, 4, 5)).to(memory_format=torch.channels_last),
        "size_one_stride_zero": random_tensor(4).as_strided((1, 4), (0, 1)),
        "expanded": random_tensor(4).expand(3, 4),
        "empty_expanded": torch.empty(0, 1).expand(0, 4),
        "empty": torch.empty(0),
        "zero_dim": random_tensor(()),
        "overlapping_strides": random_tensor(10).as_strided((4, 4), (1, 1)),
        "conj": random_tensor(3, torch.complex64).conj(),
        "conj_transposed": random_tensor((2, 3), torch.complex64).conj().t(),
        "neg": torch._neg_view(random_tensor(3)),
        "parameter": nn.Parameter(random_tensor(6)),
        "bool": random_tensor(5, torch.bool),
        "float64": random_tensor((2, 2), torch.float64),
    }


def test_the_short_way_finds_what_the_full_checks_find(tmp_path: Path) -> None:
    """For each kind of target, the one pass of load_into's checks reports exactly the messages
    and memory ranges that the full check of every target gives."""
    cases = _destination_cases()
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({k: random_tensor(tuple(t.shape), t.dtype) for k, t in cases.items()}, path)
    with ckptstream.open(path) as reader:
        entries = {e.path: e for e in reader.entries()}
    targets: dict[KeyPath, torch.Tensor] = {(k,): t for k, t in cases.items()}
    found = load_into._survey(targets, entries)
    full = load_into._Survey()
    for p, t in targets.items():
        load_into._check_target(p, t, full)
    assert (found.missing, found.wrong) == ([], [])
    assert found.unfit == full.unfit
    assert sorted(found.spans) == sorted(full.spans)
    refused = {"meta", "sparse", "expanded", "empty_expanded", "overlapping_strides", "conj", "conj_transposed", "neg"}
    assert [m.split(" ")[0].rstrip(":") for m in found.unfit] == [k for k in cases if k in refused]
    # the bytes from each target's first element to past its last (none for those without elements)
    extents = {"plain": 48, "meta": 48, "offset_slice": 40, "strided_slice": 148, "transposed": 80,
               "channels_last": 480, "size_one_stride_zero": 16, "expanded": 16, "zero_dim": 4,
               "overlapping_strides": 28, "conj": 24, "conj_transposed": 48, "neg": 12, "parameter": 24, "bool": 5,
               "float64": 32}  # fmt: skip
    expected = [(cases[k].data_ptr(), cases[k].data_ptr() + n, (k,)) for k, n in extents.items()]
    assert sorted(found.spans) == sorted(expected)


@pytest.mark.parametrize("bad", ["conj", "neg", "empty_expanded"])
def test_a_contiguous_target_that_cannot_be_written_is_refused(tmp_path: Path, bad: str) -> None:
    """Targets whose strides look contiguous but whose memory does not hold what they show (a
    lazy conjugate or negation) or whose empty shape hides an expanded dimension are refused."""
    source = {"conj": random_tensor(4, torch.complex64), "neg": random_tensor(4),
              "empty_expanded": torch.empty(0, 4)}[bad]  # fmt: skip
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"a": random_tensor((64, 64)), "b": source}, path)
    a = poisoned_like(random_tensor((64, 64)))
    b = {"conj": poisoned_like(source).conj(), "neg": torch._neg_view(poisoned_like(source)),
         "empty_expanded": torch.empty(0, 1).expand(0, 4)}[bad]  # fmt: skip
    assert b.is_contiguous()
    reason = "expanded view" if bad == "empty_expanded" else "lazy conjugate or negative view"
    with pytest.raises(ckptstream.StateMismatchError, match=rf"nothing was written:\n  b .*{reason}"):
        ckptstream.load_into({"a": a, "b": b}, path)
    assert is_poisoned(a)


def test_a_size_one_dimension_with_stride_zero_is_filled(tmp_path: Path) -> None:
    """A stride of 0 on a dimension of one element shares nothing: torch calls the tensor
    contiguous, and it is filled."""
    source = random_tensor((1, 4))
    ckptstream.save({"w": source}, tmp_path / "ckpt.safetensors")
    base = poisoned_like(random_tensor(4))
    target = base.as_strided((1, 4), (0, 1))
    assert target.stride() == (0, 1)
    assert target.is_contiguous()
    ckptstream.load_into({"w": target}, tmp_path / "ckpt.safetensors")
    assert_bytes_equal(base, source.reshape(4))


def test_an_overlap_reaching_past_a_shorter_view_is_found(tmp_path: Path) -> None:
    """A target that overlaps a long one only after a shorter one in between (both views the
    file stores over the same bytes, which may overlap) is still refused."""
    base, other = random_tensor(100), random_tensor(10)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"m": {"whole": base, "half": base[:10], "c": other}}, path)
    memory = poisoned_like(base)
    target = {"m": {"whole": memory, "half": memory[:10], "c": memory[20:30]}}
    with pytest.raises(ckptstream.StateMismatchError, match=r"\n  m\.whole and m\.c overlap in memory"):
        ckptstream.load_into(target, path)
    assert is_poisoned(memory)


def test_a_target_the_memory_of_another_still_clashes_with_views(tmp_path: Path) -> None:
    """Target n is the very memory of m.whole, which the file stores as a view, as it does
    m.half; n's bytes are stored apart, so its overlap with m.half is refused."""
    base = random_tensor(100)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"m": {"whole": base, "half": base[10:50]}, "n": random_tensor(100)}, path)
    memory = poisoned_like(base)
    target = {"m": {"whole": memory, "half": memory[10:50]}, "n": memory}
    with pytest.raises(ckptstream.StateMismatchError, match=r"\n  n and m\.half overlap in memory"):
        ckptstream.load_into(target, path)
    assert is_poisoned(memory)


def test_targets_of_two_storages_over_one_memory_are_refused(tmp_path: Path) -> None:
    """Two storages can hold the same memory (torch.frombuffer twice over one buffer): their
    tensors overlap however their storages are told apart."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"a": random_tensor(100), "b": random_tensor(10)}, path)
    buffer = bytearray(as_bytes(poisoned_like(random_tensor(100))))
    a = torch.frombuffer(buffer, dtype=torch.float32)
    b = torch.frombuffer(buffer, dtype=torch.float32, count=10, offset=40)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    with pytest.raises(ckptstream.StateMismatchError, match=r"\n  a and b overlap in memory"):
        ckptstream.load_into({"a": a, "b": b}, path)
    assert is_poisoned(a)


def test_many_targets_share_one_storage(tmp_path: Path) -> None:
    """Views of one flat buffer, back to back and stored apart, are filled; one more that spans
    two of them is refused."""
    parts = {f"p{i}": random_tensor(i + 1) for i in range(50)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(parts, path)
    flat = poisoned_like(random_tensor(sum(t.numel() for t in parts.values())))
    views = dict(zip(parts, flat.split([t.numel() for t in parts.values()]), strict=True))
    ckptstream.load_into(views, path)
    assert_bytes_equal(flat, torch.cat(list(parts.values())))

    ckptstream.save({**parts, "span": random_tensor(10)}, path)
    poison(flat)
    with pytest.raises(ckptstream.StateMismatchError) as e:
        ckptstream.load_into({**views, "span": flat[50:60]}, path)  # p9 holds flat[45:55], p10 flat[55:66]
    assert [line.split(" overlap")[0] for line in str(e.value).splitlines()[1:]] == ["  p9 and span", "  span and p10"]
    assert is_poisoned(flat)


def test_strict_reports_an_empty_target_the_file_lacks(tmp_path: Path) -> None:
    """An empty tensor is never tied to another (it has no memory): the file lacking it is a
    missing key, whatever memory address it reports."""
    ckptstream.save({"a": random_tensor(3)}, tmp_path / "ckpt.safetensors")
    a = poisoned_like(random_tensor(3))
    with pytest.raises(ckptstream.StateMismatchError, match=r"missing from the file: e$"):
        ckptstream.load_into({"a": a, "e": a[:0]}, tmp_path / "ckpt.safetensors")
    assert is_poisoned(a)
