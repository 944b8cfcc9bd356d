"""``ckptstream.open``: the lazy reader. Its index (keys, entries with the file's bytes and their
CRC-32C, leaves, metadata), its reads (whole tensors, into given tensors, boxes), errors named
by the user's key paths, reads that touch only their bytes, plain safetensors files, ambiguous
keys, and its file descriptor."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import safetensors.torch
import torch

import ckptstream
from ckptstream import Settings
from tests.helpers import (
    MiB,
    as_bytes,
    assert_bytes_equal,
    is_poisoned,
    open_fds,
    poison,
    poisoned_like,
    random_tensor,
)
from tests.memstore import MemStorage
from tests.storages import Place

METADATA = {"run": "reader", "note": "ünïcode"}


def make_state() -> dict[str, Any]:
    """Containers of every kind, str and int keys, a tensor under two keys, views of one storage
    (nested, so stored as views of one blob), 0-d and empty tensors, non-tensor leaves."""
    w = random_tensor((40, 33))  # 5280 bytes: rows and columns cross 4 KiB chunks
    base = random_tensor(600, torch.float64)
    return {
        "model": collections.OrderedDict([
            ("w", w), ("head", w), ("b", random_tensor(33, torch.bfloat16)),
            ("scalar", random_tensor((), torch.float64)), ("empty", random_tensor((0, 5))),
        ]),
        "optim": {
            "state": {0: {"exp_avg": random_tensor((17, 9), torch.float16), "step": torch.tensor(3.0)},
                      1: {"exp_avg": random_tensor(9, torch.float16), "step": torch.tensor(4.0)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "name": None}],
        },
        "views": {"whole": base, "head": base[:300], "grid": base[100:500].view(20, 20).t()},
        "layers": [random_tensor((7, 3), torch.int32), (random_tensor(5, torch.uint8), "tag")],
        "step": 12,
    }  # fmt: skip


def tensor_leaves(state: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(key path, tensor) of every tensor leaf, in the state's order."""
    if isinstance(state, torch.Tensor):
        yield ".".join(map(str, prefix)), state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from tensor_leaves(v, (*prefix, k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensor_leaves(v, (*prefix, i))


@pytest.fixture
def saved(place: Place) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """A checkpoint of ``make_state()`` on the local file system and in memory (``mem://``)."""
    state = make_state()
    path = place.path("ckpt.safetensors")
    ckptstream.save(state, path, metadata=METADATA)
    return path, state, dict(tensor_leaves(state))


@pytest.fixture
def saved_file(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """The same in a local file (for what concerns its descriptor)."""
    state = make_state()
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path, metadata=METADATA)
    return path, state, dict(tensor_leaves(state))


def test_index_lists_every_tensor_with_its_dtype_and_shape(saved: Any) -> None:
    path, _, tensors = saved
    with ckptstream.open(path) as reader:
        assert reader.keys() == list(tensors)
        assert list(reader) == list(tensors)
        assert len(reader) == len(tensors)
        assert reader.format == "ckptstream 1"
        assert reader.checksummed
        for key, t in tensors.items():
            assert key in reader
            e = reader.entry(key)
            assert (e.key, e.dtype, e.shape, e.nbytes) == (key, t.dtype, tuple(t.shape), t.numel() * t.element_size())
        assert "model" not in reader
        assert "nope" not in reader
        with pytest.raises(KeyError, match=r"no tensor 'model\.nope'"):
            reader.entry("model.nope")
        assert reader.entry(("optim", "state", 0, "exp_avg")).key == "optim.state.0.exp_avg"  # an int key


def test_entries_are_the_dataclass_they_say(saved: Any) -> None:
    """The index's entries, made without TensorEntry's __init__, equal entries made with it,
    field by field, and stay frozen."""
    path, _, _ = saved
    with ckptstream.open(path) as reader:
        entries = reader.entries()
    assert {e.key for e in entries} >= {"optim.state.0.exp_avg", "views.grid", "model.head"}  # int keys, views, ties
    for e in entries:
        fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(ckptstream.TensorEntry)}
        assert fields["key"] == ".".join(map(str, e.path))
        made = ckptstream.TensorEntry(**fields)
        assert made == e
        assert hash(made) == hash(e)
        assert repr(made) == repr(e)
        assert vars(made) == vars(e)
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.offset = 0  # type: ignore[misc]


def test_entries_are_the_files_bytes_and_their_crc32c(saved: Any, place: Place) -> None:
    path, _, tensors = saved
    raw = place.read_bytes(path)
    with ckptstream.open(path) as reader:
        for key, t in tensors.items():
            e = reader.entry(key)
            assert e.checksum == int(crc32c.crc32c(raw[e.offset : e.end])), key
            if e.view is None:
                assert raw[e.offset : e.end] == as_bytes(t), key
        w, head = reader.entry("model.w"), reader.entry("model.head")
        assert (w.stored_as, w.offset, w.end) == (head.stored_as, head.offset, head.end)  # stored once
        views = [reader.entry(f"views.{k}") for k in ("whole", "head", "grid")]
        assert len({(e.stored_as, e.offset, e.end) for e in views}) == 1  # one blob of the storage
        assert all(e.view is not None for e in views)
        assert views[0].end - views[0].offset == 600 * 8
        assert raw[views[0].offset : views[0].end] == as_bytes(tensors["views.whole"])


def test_leaves_and_metadata(saved: Any) -> None:
    path, _, _ = saved
    with ckptstream.open(path) as reader:
        assert reader.leaves == {"optim.param_groups.0.lr": 0.1, "optim.param_groups.0.params.0": 0,
                                 "optim.param_groups.0.params.1": 1, "optim.param_groups.0.name": None,
                                 "layers.1.1": "tag", "step": 12}  # fmt: skip
        assert reader.metadata == METADATA
        skeleton = reader.skeleton()
        assert skeleton["model"]["w"] is reader.entry("model.w")
        assert type(skeleton["model"]) is collections.OrderedDict
        assert type(skeleton["layers"][1]) is tuple


# --- reads ----------------------------------------------------------------------------------------

BUFFERS = [4096, 4099, 4100]  # 4099: chunk edges cut elements of every size


def open_small(path: str, buffer_size: int) -> ckptstream.CheckpointReader:
    return ckptstream.open(path, settings=Settings(buffer_size=buffer_size, num_buffers=2, io_threads=2,
                                                   direct_io="off"))


@pytest.mark.parametrize("buffer_size", BUFFERS)
def test_read_every_tensor(device: torch.device, saved: Any, buffer_size: int) -> None:
    path, _, tensors = saved
    with open_small(path, buffer_size) as reader:
        for key, t in tensors.items():
            out = reader.read(key, device=device)
            assert out.device.type == device.type, key
            assert_bytes_equal(out, t)


def _non_contiguous_destination(t: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A poisoned base and a non-contiguous view of it shaped like ``t``."""
    if t.dim() >= 2:
        base = poisoned_like(t.transpose(0, 1).contiguous()).to(device)
        return base, base.transpose(0, 1)
    base = poison(torch.empty(2 * max(t.numel(), 1) + 1, dtype=t.dtype, device=device))
    return base, base[1 : 1 + 2 * t.numel() : 2].view(t.shape)


@pytest.mark.parametrize("buffer_size", BUFFERS)
def test_read_into_contiguous_and_non_contiguous_destinations(device: torch.device, saved: Any,
                                                              buffer_size: int) -> None:
    path, _, tensors = saved
    with open_small(path, buffer_size) as reader:
        for key, t in tensors.items():
            dst = poisoned_like(t).to(device)
            assert reader.read_into(key, dst) is dst
            assert_bytes_equal(dst, t)
            base, view = _non_contiguous_destination(t, device)
            reader.read_into(key, view)
            assert_bytes_equal(view, t)
            if t.dim() >= 2:
                assert_bytes_equal(base, t.transpose(0, 1).contiguous())
            else:  # the elements between and around the view's keep their poison
                kept = torch.ones(base.numel(), dtype=torch.bool, device=device)
                kept[1 : 1 + 2 * t.numel() : 2] = False
                assert is_poisoned(base[kept]), key
        with pytest.raises(ckptstream.StateMismatchError, match=r"model\.w is torch\.float32 \[40, 33\]"):
            reader.read_into("model.w", torch.empty(33, 40))


SLICES: list[tuple[str, tuple[Any, ...]]] = [
    ("model.w", (slice(5, 16),)),  # rows: one run of the file
    ("model.w", (slice(None), slice(7, 12))),  # columns: a run per row
    ("model.w", (slice(3, 10), slice(4, 24))),
    ("model.w", (3,)),
    ("model.w", (-1, slice(2, 9))),
    ("model.w", (slice(5, 5),)),  # no rows
    ("model.head", (slice(30, 40), slice(1, 32))),  # the tied twin
    ("model.b", (slice(3, 23),)),
    ("model.scalar", ()),
    ("model.empty", (slice(None), slice(1, 4))),
    ("optim.state.0.exp_avg", (slice(1, 16), slice(2, 7))),
    ("optim.state.1.exp_avg", (slice(1, 8),)),
    ("views.head", (slice(17, 290),)),  # views of one shared storage
    ("views.grid", (slice(2, 18), slice(5, 6))),
    ("layers.1.0", (4,)),
]


@pytest.mark.parametrize("buffer_size", BUFFERS)
def test_read_slices_and_get_slice(device: torch.device, saved: Any, buffer_size: int) -> None:
    path, _, tensors = saved
    with open_small(path, buffer_size) as reader:
        for key, index in SLICES:
            expected = tensors[key][index]
            got = reader.get_slice(key)[index]
            assert_bytes_equal(got, expected)
            box = [(i.indices(n)[0], len(range(*i.indices(n)))) if isinstance(i, slice) else (i % n, 1)
                   for i, n in zip(index, tensors[key].shape, strict=False)]
            offsets, lengths = [o for o, _ in box], [n for _, n in box]
            out = reader.read_slices([(key, offsets, lengths + list(tensors[key].shape[len(box):]), device)])[0]
            assert out.device.type == device.type
            assert_bytes_equal(out, tensors[key][tuple(slice(o, o + n) for o, n in box)])
            if out.dim() >= 2 and out.numel():  # into a poisoned non-contiguous destination
                base = poisoned_like(out.transpose(0, 1).contiguous())
                into = base.transpose(0, 1)
                assert reader.read_slices([(key, offsets, list(out.shape), into)])[0] is into
                assert_bytes_equal(into, out)
        sliced = reader.get_slice("model.w")
        assert sliced.get_shape() == [40, 33]
        assert sliced.get_dtype() == torch.float32


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda r: r.read_slices([("model.w", [41], [1], "cpu")]), IndexError, r"model\.w: dimension 0 of size 40"),
    (lambda r: r.read_slices([("model.w", [0, 30], [1, 4], "cpu")]), IndexError, r"model\.w: dimension 1 of size 33"),
    (lambda r: r.read_slices([("model.w", [-1], [1], "cpu")]), IndexError, r"model\.w"),
    (lambda r: r.read_slices([("model.b", [0, 0], [1, 1], "cpu")]), IndexError,
     r"model\.b: a slice of a tensor of shape \[33\]"),
    (lambda r: r.get_slice("model.w")[40], IndexError, r"model\.w: index 40 is out of range"),
    (lambda r: r.get_slice("model.w")[::2], IndexError, r"model\.w: only slices of step 1"),
    (lambda r: r.get_slice("model.b")[1, 2], IndexError, r"model\.b: 2 indices for a tensor of 1 dimensions"),
    (lambda r: r.get_slice("model.w")["x"], TypeError, r"model\.w: index with ints and slices"),
    (lambda r: r.read_slices([("views.grid", [0, 21], [1, 1], "cpu")]), IndexError, r"views\.grid"),
], ids=["row_past_end", "columns_past_end", "negative", "too_many_dims", "index", "step", "too_many_indices",
        "not_an_index", "view"])  # fmt: skip
def test_bad_boxes_name_the_key(saved: Any, call: Any, error: type[Exception], message: str) -> None:
    path, _, _ = saved
    with ckptstream.open(path) as reader, pytest.raises(error, match=message):
        call(reader)


# --- errors by the user's key paths -----------------------------------------------------------------


@pytest.mark.parametrize("key", ["model.w", "model.b", "views.grid", "optim.state.0.exp_avg", "layers.1.0"])
def test_a_corrupt_tensor_is_named_by_its_key_path(saved: Any, place: Place, key: str) -> None:
    path, _, tensors = saved
    with ckptstream.open(path) as reader:
        e = reader.entry(key)
        sharing = [k for k in reader if reader.entry(k).stored_as == e.stored_as]
    place.flip(path, e.offset + (e.end - e.offset) // 2)
    with ckptstream.open(path) as reader:
        for call in (lambda: reader.read(key), lambda: reader.read_into(key, torch.empty_like(tensors[key])),
                     reader.verify):
            with pytest.raises(ckptstream.CorruptCheckpointError, match="fails its CRC-32C check") as info:
                call()
            message = str(info.value)
            assert str(path) in message
            for k in sharing:  # every key stored in those bytes, by its key path
                assert repr(k) in message, message
            assert e.stored_as == key or repr(e.stored_as) not in message, message
            assert "__storage__" not in message, message
        other = "model.b" if key != "model.b" else "model.w"
        assert_bytes_equal(reader.read(other), tensors[other])  # the other tensors read fine
    with pytest.raises(ckptstream.CorruptCheckpointError, match=repr(key).replace(".", r"\.")):
        ckptstream.load(path)


# --- reads touch only their bytes ------------------------------------------------------------------


def test_reading_one_tensor_touches_only_its_bytes(mem: MemStorage) -> None:
    """Every read of the storage (in memory, which notes each one's offset and length)."""
    state = {"a": random_tensor(MiB), "b": random_tensor((512, 1024)), "c": random_tensor(MiB)}  # 4 MiB each
    path, file_reads = "mem://test/big.safetensors", mem.reads
    ckptstream.save(state, path)
    with ckptstream.open(path, settings=Settings(buffer_size=256 << 10, num_buffers=2)) as reader:
        e = reader.entry("b")
        file_reads.clear()
        assert_bytes_equal(reader.read("b"), state["b"])
        assert file_reads
        assert all(e.offset <= at and at + n <= e.end for at, n in file_reads), file_reads
        assert sum(n for _, n in file_reads) == e.end - e.offset  # each byte once
        for dst in (torch.empty(512, 1024), torch.empty(1024, 512).t()):  # straight into it, and staged
            file_reads.clear()
            reader.read_into("b", dst)
            assert_bytes_equal(dst, state["b"])
            assert all(e.offset <= at and at + n <= e.end for at, n in file_reads), file_reads
        file_reads.clear()
        assert_bytes_equal(reader.read_slices([("b", [100], [3], "cpu")])[0], state["b"][100:103])  # rows 100..102
        row = 1024 * 4
        assert file_reads == [(e.offset + 100 * row, 3 * row)]
        file_reads.clear()
        assert_bytes_equal(reader.get_slice("b")[7:9, 10:12], state["b"][7:9, 10:12])  # a run per row
        assert sorted(file_reads) == [(e.offset + 7 * row + 40, 8), (e.offset + 8 * row + 40, 8)]


# --- plain safetensors files, ambiguous keys ----------------------------------------------------------


def test_a_safetensors_file_opens_as_a_flat_dict(device: torch.device, tmp_path: Path) -> None:
    tensors = {"embed.weight": random_tensor((11, 6)), "norm": random_tensor(6, torch.bfloat16),
               "ids": random_tensor(5, torch.int64)}  # fmt: skip
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    with ckptstream.open(path) as reader:
        assert reader.format == "safetensors"
        assert not reader.checksummed
        assert sorted(reader.keys()) == sorted(tensors)
        assert reader.leaves == {}
        assert reader.metadata == {"format": "pt"}
        for key, t in tensors.items():
            e = reader.entry(key)
            assert (e.stored_as, e.dtype, e.shape, e.checksum, e.view) == (key, t.dtype, tuple(t.shape), None, None)
            assert raw[e.offset : e.end] == as_bytes(t)
            assert_bytes_equal(reader.read(key, device=device), t)
        assert_bytes_equal(reader.get_slice("embed.weight")[2:5, 1:3], tensors["embed.weight"][2:5, 1:3])
        reader.verify()  # the structure only: there are no checksums
        loaded = reader.load(device=device)
    assert type(loaded) is dict
    assert sorted(loaded) == sorted(tensors)


def test_ambiguous_keys_need_tuple_paths(tmp_path: Path) -> None:
    dotted, nested, one, one_str = random_tensor(3), random_tensor(4), random_tensor(5), random_tensor(6)
    state = {"a.b": dotted, "a": {"b": nested}, 1: one, "1": one_str, "c": random_tensor(2)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    with ckptstream.open(path) as reader:
        # each path once, as what entry() takes: the shared strings as their tuples
        assert reader.keys() == [("a.b",), ("a", "b"), (1,), ("1",), "c"]
        assert list(reader) == reader.keys()
        assert [reader.entry(k).path for k in reader] == [("a.b",), ("a", "b"), (1,), ("1",), ("c",)]
        for key in ("a.b", "1"):
            assert key not in reader
            with pytest.raises(KeyError, match=r"several tensors have the key path .* pass the path as a tuple"):
                reader.entry(key)
            with pytest.raises(KeyError, match="several tensors"):
                reader.read(key)
        for path_, t in ((("a.b",), dotted), (("a", "b"), nested), ((1,), one), (("1",), one_str)):
            assert path_ in reader
            assert reader.entry(path_).path == path_
            assert_bytes_equal(reader.read(path_), t)
            assert_bytes_equal(reader.get_slice(path_)[1:], t[1:])


def test_the_same_tensor_under_keys_that_print_alike_is_listed_once_per_path(tmp_path: Path) -> None:
    t = random_tensor((3, 5))
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"a.b": t, "a": {"b": t}}, path)
    with ckptstream.open(path) as reader:
        assert reader.keys() == [("a.b",), ("a", "b")]
        assert len(reader.keys()) == len(reader) == 2
        for key in reader:
            assert_bytes_equal(reader.read(key), t)


# --- the descriptor ---------------------------------------------------------------------------------


def descriptors_of(path: Path) -> list[int]:
    return [fd for fd, target in open_fds().items() if target == str(path)]


def test_the_reader_closes_its_descriptor(saved_file: Any) -> None:
    path, _, tensors = saved_file
    with ckptstream.open(path) as reader:
        assert len(descriptors_of(path)) == 1
        reader.read("model.w")
    assert descriptors_of(path) == []
    reader = ckptstream.open(path)
    assert_bytes_equal(reader.read("model.b"), tensors["model.b"])
    reader.close()
    reader.close()  # safe twice
    assert descriptors_of(path) == []


@pytest.mark.parametrize("damage", ["header_length", "json", "truncated", "structure"])
def test_a_failed_open_leaks_no_descriptor(saved_file: Any, damage: str) -> None:
    path, _, _ = saved_file
    raw = bytearray(path.read_bytes())
    if damage == "header_length":
        raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    elif damage == "json":
        raw[8] = ord("[")
    elif damage == "truncated":
        del raw[-10:]
    else:
        at = raw.index(b'"ckptstream.structure":"') + len(b'"ckptstream.structure":"')
        raw[at] = ord("[")
    path.write_bytes(bytes(raw))
    before = open_fds()
    with pytest.raises(ckptstream.CorruptCheckpointError, match=str(path).replace(".", r"\.")):
        ckptstream.open(path)
    assert descriptors_of(path) == []
    assert set(open_fds()) <= set(before)
    with pytest.raises(FileNotFoundError):
        ckptstream.open(path.parent / "absent.safetensors")
    assert set(open_fds()) <= set(before)
    assert os.path.exists(path)
