"""StreamCheckpointIO without a Trainer: the value policy (plain subclasses stored as their base,
a few types restored, everything else refused by key path or pickled only when asked), its
arguments and errors, and what waits for a background save."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import os
import pathlib
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict

import ckptstream
from ckptstream import CorruptCheckpointError, UnsupportedStorageError, UnsupportedTypeError
from ckptstream.lightning import TYPES_KEY, StorageOptionsError, StreamCheckpointIO
from tests.helpers import child_env
from tests.lightningutil import held_saves

SRC = str(Path(__file__).resolve().parents[1] / "src")
ASYNC = ["device", "lazy", "host"]


class Pair(NamedTuple):
    low: int
    high: torch.Tensor


class Tagged(str):
    pass


class Distinct(str):
    """A str subclass whose instances differ from the str of the same text."""

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class Ordered(collections.OrderedDict):
    pass


@dataclasses.dataclass
class Config:
    depth: int = 3


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Stage(str, enum.Enum):  # what enum.StrEnum is (Python 3.11+)
    FIT = "fit"


class Access(enum.IntFlag):
    READ = 4


class Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)

    __hash__ = object.__hash__


def lightning_like() -> dict[str, Any]:
    """A checkpoint with every kind of value the policy converts, random tensors among them."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    sd = model.state_dict()
    for t in sd.values():
        if t.is_floating_point():
            t.copy_(torch.randn_like(t))
    return {
        "epoch": 3, "global_step": 41, "state_dict": sd,
        "hyper_parameters": AttributeDict(lr=0.5,
                                          args=argparse.Namespace(width=64, name="x", nested=AttributeDict(a=1)),
                                          root=pathlib.Path("/data/set"), posix=pathlib.PurePosixPath("a/b"),
                                          win=pathlib.PureWindowsPath("C:/x"), dtype=torch.bfloat16,
                                          device=torch.device("cpu"), scale=np.float64(0.1)),
        "fabric": FabricAttributeDict(k=torch.randn(3)),
        "callbacks": {"Cb{'a': 1}": {"pair": Pair(2, torch.randn(4)), "counts": collections.defaultdict(int, x=2),
                                     "odict": Ordered(b=1, a=2), Tagged("key"): Tagged("value"),
                                     "shape": torch.Size([2, 3]),
                                     "in_tuple": (1, pathlib.Path("p"), [torch.Size([4])])}},
    }


@pytest.mark.parametrize("mode", [None, *ASYNC])
def test_values_come_back_as_lightning_needs(tmp_path: Path, mode: str | None) -> None:
    ckpt = lightning_like()
    io = StreamCheckpointIO(mode)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    io.teardown()
    ckptstream.verify(tmp_path / "a.ckpt")
    back = StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    hp = back["hyper_parameters"]
    assert type(hp) is AttributeDict
    assert hp.lr == 0.5
    assert type(hp.args) is argparse.Namespace
    assert vars(hp.args) == {"width": 64, "name": "x", "nested": AttributeDict(a=1)}
    assert type(hp.args.nested) is AttributeDict
    assert type(hp.root) is type(pathlib.Path("/"))
    assert hp.root == pathlib.Path("/data/set")
    assert type(hp.posix) is pathlib.PurePosixPath
    assert hp.posix == pathlib.PurePosixPath("a/b")
    assert type(hp.win) is pathlib.PureWindowsPath
    assert hp.win == pathlib.PureWindowsPath("C:/x")
    assert hp.dtype is torch.bfloat16
    assert hp.device == torch.device("cpu")
    assert type(hp.scale) is float
    assert hp.scale == 0.1
    assert isinstance(back["fabric"], FabricAttributeDict)
    assert torch.equal(back["fabric"]["k"], ckpt["fabric"]["k"])
    cb = back["callbacks"]["Cb{'a': 1}"]
    assert type(cb["pair"]) is tuple
    assert cb["pair"][0] == 2
    assert torch.equal(cb["pair"][1], ckpt["callbacks"]["Cb{'a': 1}"]["pair"].high)
    assert type(cb["counts"]) is dict
    assert cb["counts"] == {"x": 2}
    assert type(cb["odict"]) is collections.OrderedDict
    assert list(cb["odict"].items()) == [("b", 1), ("a", 2)]
    assert cb["key"] == "value"
    assert type(next(k for k in cb if k == "key")) is str
    assert type(cb["key"]) is str
    assert type(cb["shape"]) is torch.Size
    assert cb["shape"] == (2, 3)
    assert cb["in_tuple"] == (1, pathlib.Path("p"), [torch.Size([4])])
    assert type(cb["in_tuple"][2][0]) is torch.Size
    sd = back["state_dict"]
    assert type(sd) is collections.OrderedDict
    assert sd._metadata == ckpt["state_dict"]._metadata  # type: ignore[attr-defined]  # load_state_dict reads the modules' versions
    for key, t in ckpt["state_dict"].items():
        assert torch.equal(sd[key], t)
    # a plain load sees plain containers: the restored types are the plug-in's alone
    plain = ckptstream.load(tmp_path / "a.ckpt")
    assert type(plain["hyper_parameters"]) is dict
    assert plain["hyper_parameters"]["root"] == "/data/set"
    assert plain["hyper_parameters"]["args"] == {"width": 64, "name": "x", "nested": {"a": 1}}
    assert TYPES_KEY in ckptstream.read_metadata(tmp_path / "a.ckpt")


@pytest.mark.parametrize(("value", "hint"), [
    (Config(), "dataclasses.asdict"),
    (Color.RED, "value.name"),
    ({1, 2}, "sorted(value)"),
    (b"raw", "torch.frombuffer"),
    (np.arange(3), "torch.from_numpy"),
    (Opaque(), "convert it to dicts"),
    (Config, "the class's name"),
], ids=["dataclass", "enum", "set", "bytes", "numpy", "object", "class"])
def test_an_object_is_refused_by_its_key_path(tmp_path: Path, value: Any, hint: str) -> None:
    ckpt = {"state_dict": {"w": torch.randn(3)}, "callbacks": {"My.Callback{'k': 1}": {"things": [0, {"it": value}]}}}
    for mode in [None, "device"]:
        with pytest.raises(UnsupportedTypeError) as raised:
            StreamCheckpointIO(mode).save_checkpoint(ckpt, tmp_path / "a.ckpt")
        message = str(raised.value)
        assert "checkpoint['callbacks'][\"My.Callback{'k': 1}\"]['things'][1]['it']" in message
        assert (value if isinstance(value, type) else type(value)).__qualname__ in message
        assert hint in message
        assert "allow_pickle=True" in message
    assert os.listdir(tmp_path) == []  # refused before any file


@pytest.mark.parametrize("member", [Level.HIGH, Stage.FIT, Access.READ], ids=["IntEnum", "StrEnum", "IntFlag"])
def test_an_enum_that_is_also_an_int_or_str_is_refused_not_flattened(tmp_path: Path, member: enum.Enum) -> None:
    # stored as its value, it would load as a plain int or str: equal to the member, but no longer one
    plain = "int" if isinstance(member, int) else "str"
    ckpt = {"w": torch.randn(3), "loops": {"fit": {"state": [{"stage": member}]}}}
    for mode in [None, "device"]:
        with pytest.raises(UnsupportedTypeError) as raised:
            StreamCheckpointIO(mode).save_checkpoint(ckpt, tmp_path / "a.ckpt")
        message = str(raised.value)
        assert "checkpoint['loops']['fit']['state'][0]['stage']" in message
        assert f"tests.test_lightning_io.{type(member).__qualname__}" in message
        assert f"look the member up where it is read ({type(member).__qualname__}[name])" in message
        assert f"would come back as a plain {plain}" in message
    # as a dict key it is refused even with pickle allowed: keys are never pickled
    with pytest.raises(UnsupportedTypeError, match=rf"checkpoint\['d'\]: dict key .* is a member of the enum "
                       rf"tests\.test_lightning_io\.{type(member).__qualname__}.*use key\.name as the key"):
        StreamCheckpointIO(allow_pickle=True).save_checkpoint({"d": {member: 1}}, tmp_path / "a.ckpt")
    assert os.listdir(tmp_path) == []
    # with pickle allowed, the member comes back as itself (in a tuple too)
    StreamCheckpointIO(allow_pickle=True).save_checkpoint({"d": {"m": member, "t": (member, 5)}}, tmp_path / "b.ckpt")
    back = StreamCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "b.ckpt")["d"]
    assert type(back["m"]) is type(member)
    assert back["m"] is member
    assert type(back["t"]) is tuple
    assert back["t"][0] is member
    assert back["t"][1] == 5


def test_a_dict_key_that_is_not_text_or_int_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedTypeError, match=r"checkpoint\['loops'\]: dict key \(1, 2\) is a builtins.tuple"):
        StreamCheckpointIO().save_checkpoint({"loops": {(1, 2): 3}}, tmp_path / "a.ckpt")
    with pytest.raises(UnsupportedTypeError, match="two keys of this dict are equal"):
        StreamCheckpointIO().save_checkpoint({"d": {"k": 1, Distinct("k"): 2}}, tmp_path / "a.ckpt")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", [None, "device"])
def test_a_bool_dict_key_comes_back_a_bool(tmp_path: Path, mode: str | None) -> None:
    flagged = torch.randn(3)
    ckpt = {"w": torch.randn(4), "callbacks": {"Cb": {"by_flag": {True: flagged, False: [1, {True: "yes"}]},
                                                      "ordered": collections.OrderedDict([(False, 0), ("x", 1),
                                                                                          (True, 2), (7, 3)]),
                                                      "hp": AttributeDict({True: 1.5}), "flag": True}}}
    io = StreamCheckpointIO(mode)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    io.teardown()
    back = StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")["callbacks"]["Cb"]
    assert [(type(k), k) for k in back["by_flag"]] == [(bool, True), (bool, False)]
    assert torch.equal(back["by_flag"][True], flagged)
    assert [(type(k), k) for k in back["by_flag"][False][1]] == [(bool, True)]
    assert back["by_flag"][False] == [1, {True: "yes"}]
    assert type(back["ordered"]) is collections.OrderedDict
    assert [(type(k), k) for k in back["ordered"]] == [(bool, False), (str, "x"), (bool, True), (int, 7)]
    assert list(back["ordered"].values()) == [0, 1, 2, 3]
    assert type(back["hp"]) is AttributeDict
    assert [(type(k), k) for k in back["hp"]] == [(bool, True)]
    assert back["hp"][True] == 1.5
    assert back["flag"] is True
    # a plain load holds what the file stores: their ints
    plain = ckptstream.load(tmp_path / "a.ckpt")["callbacks"]["Cb"]
    assert [(type(k), k) for k in plain["ordered"]] == [(int, 0), (str, "x"), (int, 1), (int, 7)]
    assert [(type(k), k) for k in plain["by_flag"]] == [(int, 1), (int, 0)]


def test_a_damaged_bool_key_row_is_named(tmp_path: Path) -> None:
    plain = {"d": {0: "a", 1: "b", "k": "c"}, "e": {"k": 1}, "t": "x"}
    rows = [("d", "[2]"), ("d", "[1, 1]"), ("d", "[]"), ("d", '["1"]'), ("d", "[true]"), ("d", "null"),
            ("e", "[1]"), ("t", "[1]")]  # not 0 or 1, twice, none, not ints; a key the dict lacks; no dict
    for key, payload in rows:
        table = f'{{"version": 1, "values": [[["{key}"], "bool_keys", {payload}]]}}'
        ckptstream.save(plain, tmp_path / "a.ckpt", metadata={TYPES_KEY: table})
        with pytest.raises(CorruptCheckpointError, match=rf"checkpoint\['{key}'\] is tagged 'bool_keys'"):
            StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")


def test_pickle_only_when_asked_on_both_sides(tmp_path: Path) -> None:
    w = torch.randn(5)
    ckpt = {"hyper_parameters": {"config": Config(7), "color": Color.RED}, "w": w}
    StreamCheckpointIO(allow_pickle=True).save_checkpoint(ckpt, tmp_path / "a.ckpt")
    with pytest.raises(UnsupportedTypeError, match=r"pickle at \[\"checkpoint\['hyper_parameters'\]\['config'\]\", "
                       r"\"checkpoint\['hyper_parameters'\]\['color'\]\"\]: loading them runs code"):
        StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(UnsupportedTypeError, match="weights_only=True loads plain data only"):
        StreamCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    back = StreamCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt")
    assert back["hyper_parameters"] == {"config": Config(7), "color": Color.RED}
    assert torch.equal(back["w"], w)
    # without objects, nothing is pickled even when allowed
    StreamCheckpointIO(allow_pickle=True).save_checkpoint({"w": w, "p": pathlib.Path("x")}, tmp_path / "b.ckpt")
    assert "pickle" not in ckptstream.read_metadata(tmp_path / "b.ckpt")[TYPES_KEY]
    assert StreamCheckpointIO().load_checkpoint(tmp_path / "b.ckpt")["p"] == pathlib.Path("x")


def test_storage_options_and_metadata(tmp_path: Path) -> None:
    io = StreamCheckpointIO(metadata={"run": "r1", "owner": "me"})
    io.save_checkpoint({"w": torch.randn(2)}, tmp_path / "a.ckpt", storage_options={"metadata": {"run": "r2"}})
    io.save_checkpoint({"w": torch.randn(2)}, tmp_path / "b.ckpt", storage_options=None)
    assert ckptstream.read_metadata(tmp_path / "a.ckpt") == {"run": "r2", "owner": "me"}
    assert ckptstream.read_metadata(tmp_path / "b.ckpt") == {"run": "r1", "owner": "me"}
    bad: list[tuple[Any, str]] = [
        ("fast", "expected None or a dict"), ({"metadata": {"k": 1}}, "metadata must map str to str"),
        ({"compress": True}, r"unknown keys \['compress'\]; it takes \['metadata'\]"),
        ({"metadata": {TYPES_KEY: "{}"}}, "is reserved"), ({"metadata": {"ckptstream.x": "1"}}, "reserved"),
    ]
    for options, message in bad:
        with pytest.raises(StorageOptionsError, match=message):
            io.save_checkpoint({"w": torch.randn(2)}, tmp_path / "c.ckpt", storage_options=options)
        assert isinstance(StorageOptionsError("x"), TypeError)
    assert not (tmp_path / "c.ckpt").exists()
    with pytest.raises(ValueError, match="is reserved"):
        StreamCheckpointIO(metadata={TYPES_KEY: "x"})


def test_arguments_and_paths_it_refuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mode must be None \(synchronous\) or one of \['device', 'lazy', 'host'\]"):
        StreamCheckpointIO("async")
    with pytest.raises(ValueError, match="max_in_flight"):
        StreamCheckpointIO("device", max_in_flight=0)
    io = StreamCheckpointIO()
    with pytest.raises(UnsupportedStorageError, match=r"nowhere://bucket/a\.ckpt: no storage for nowhere:// URLs"):
        io.save_checkpoint({"w": torch.randn(2)}, "nowhere://bucket/a.ckpt")
    io.save_checkpoint({"w": torch.randn(2)}, f"file://{tmp_path}/sub/dir/a.ckpt")  # directories are created
    assert io.load_checkpoint(tmp_path / "sub" / "dir" / "a.ckpt", map_location="cpu")["w"].shape == (2,)
    with pytest.raises(StorageOptionsError, match="map_location must be None or a device"):
        io.load_checkpoint(tmp_path / "sub" / "dir" / "a.ckpt", map_location=lambda storage, loc: storage)
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"w": torch.randn(2)}, tmp_path / "torch.ckpt")
    with pytest.raises(CorruptCheckpointError, match=r"is a torch\.save file"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # as Lightning's: nothing to remove is no error
    io.remove_checkpoint(f"file://{tmp_path}/sub/dir/a.ckpt")
    assert os.listdir(tmp_path / "sub" / "dir") == []


def test_remove_and_load_by_what_a_path_names(tmp_path: Path) -> None:
    io = StreamCheckpointIO()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "a.ckpt").write_bytes(b"mine")
    (tmp_path / "link").symlink_to(kept)
    io.remove_checkpoint(tmp_path / "link")  # the link goes, never what it points to
    assert not os.path.lexists(tmp_path / "link")
    assert (kept / "a.ckpt").read_bytes() == b"mine"
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(kept)  # a folder is no checkpoint file
    io.remove_checkpoint(kept)  # a folder (a sharded checkpoint's) goes whole
    assert not kept.exists()


def test_the_plug_in_pickles_its_options_only(tmp_path: Path) -> None:
    # Lightning pickles its strategy, the plug-in with it, for processes it spawns
    io = StreamCheckpointIO("device", metadata={"run": "a"}, max_in_flight=2)
    io.save_checkpoint({"w": torch.randn(3)}, tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(io))
    io.teardown()
    assert (copy.mode, copy.metadata, copy.max_in_flight) == ("device", {"run": "a"}, 2)
    copy.save_checkpoint({"w": torch.randn(3)}, tmp_path / "b.ckpt")
    copy.teardown()
    assert ckptstream.read_metadata(tmp_path / "b.ckpt") == {"run": "a"}


def test_a_damaged_type_table_is_named(tmp_path: Path) -> None:
    plain = {"w": torch.randn(2), "p": "x"}
    for table, message in [("not json", "is not JSON"), ('{"version": 9, "values": []}', "not a table of version 1"),
                           ('{"version": 1, "values": [[["q"], "path", "Path"]]}', r"names checkpoint\['q'\]"),
                           ('{"version": 1, "values": [[["w"], "path", "Path"]]}',
                            r"checkpoint\['w'\] is tagged 'path'"),
                           ('{"version": 1, "values": [[["p"], "os.system", null]]}', "not a table of version 1")]:
        ckptstream.save(plain, tmp_path / "a.ckpt", metadata={TYPES_KEY: table})
        with pytest.raises(CorruptCheckpointError, match=message):
            StreamCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt")


# --- what waits for a background save --------------------------------------------------------


@pytest.mark.parametrize("mode", ASYNC)
def test_remove_waits_for_the_save_of_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # the save is held before it writes a byte until someone waits for it: a removal that does
    # not wait removes nothing, and the file is published afterwards
    with held_saves(monkeypatch) as holds:
        io = StreamCheckpointIO(mode)
        io.save_checkpoint({"w": torch.randn(300_000)}, tmp_path / "a.ckpt")
        io.remove_checkpoint(tmp_path / "a.ckpt")
        io.teardown()
    assert holds.released()[0][0] in ("result", "wait_staged")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ASYNC)
def test_load_waits_for_the_save_of_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    old, new = {"w": torch.randn(300_000)}, {"w": torch.randn(300_000)}
    ckptstream.save(old, tmp_path / "a.ckpt")
    with held_saves(monkeypatch):
        io = StreamCheckpointIO(mode)
        io.save_checkpoint(new, tmp_path / "a.ckpt")
        assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], new["w"])


def test_a_save_to_the_same_path_waits_for_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = {"w": torch.randn(1000)}, {"w": torch.randn(1000)}
    with held_saves(monkeypatch) as holds:
        io = StreamCheckpointIO("device", max_in_flight=2)
        io.save_checkpoint(first, tmp_path / "a.ckpt")
        io.save_checkpoint(second, tmp_path / "a.ckpt")
        io.teardown()
    assert [why for why, _ in holds.log] == ["result", "writing", "published", "result", "writing", "published"]
    assert torch.equal(ckptstream.load(tmp_path / "a.ckpt")["w"], second["w"])


def test_teardown_raises_a_failed_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d").mkdir()
    with held_saves(monkeypatch) as holds:
        io = StreamCheckpointIO("device")
        io.save_checkpoint({"w": torch.randn(10)}, tmp_path / "d" / "a.ckpt")
        (tmp_path / "d").rmdir()  # the save finds no directory to write its temp file in
        holds.release(str(tmp_path / "d" / "a.ckpt"), "the test")
        with pytest.raises(FileNotFoundError):
            io.teardown()
        io.teardown()  # collected once: nothing left to raise
    assert os.listdir(tmp_path) == []


def test_a_failed_save_is_raised_at_teardown_after_later_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a later save_checkpoint forgets the saves that ended well: a failed one stays until teardown
    (tmp_path / "d").mkdir()
    later = {"w": torch.randn(1000)}
    with held_saves(monkeypatch) as holds:
        io = StreamCheckpointIO("device")
        io.save_checkpoint({"w": torch.randn(10)}, tmp_path / "d" / "a.ckpt")
        (tmp_path / "d").rmdir()  # the save finds no directory to write its temp file in
        holds.release(str(tmp_path / "d" / "a.ckpt"), "the test")
        with pytest.raises(ckptstream.CheckpointNotSavedError, match=r"a\.ckpt failed"):
            io.save_checkpoint({"w": torch.randn(10)}, tmp_path / "b.ckpt")  # waits for it: max_in_flight=1
        io.save_checkpoint(later, tmp_path / "c.ckpt")  # the failed save has ended: this one forgets only good ones
        with pytest.raises(FileNotFoundError):
            io.teardown()
        io.teardown()  # collected once: nothing left to raise
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]
    assert torch.equal(ckptstream.load(tmp_path / "c.ckpt")["w"], later["w"])


def test_host_mode_teardown_frees_the_kept_snapshot_memory(tmp_path: Path) -> None:
    ckptstream.release_host_snapshot()
    w = torch.randn(300_000)
    state = {"state_dict": {"w": w}, "epoch": 1}
    io = StreamCheckpointIO("host")
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.wait()
    assert ckptstream.host_snapshot_bytes() >= 1_200_000  # kept for the next save
    io.teardown()
    assert ckptstream.host_snapshot_bytes() == 0
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], w)


# --- "lazy": the state is read out before it changes -------------------------------------------


def lazy_save_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: dict[str, Any]) -> Any:
    holds_cm = held_saves(monkeypatch)
    holds = holds_cm.__enter__()
    io = StreamCheckpointIO("lazy")
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    assert holds.released() == []
    return holds_cm, holds, io


@pytest.mark.parametrize("closure", [True, False], ids=["closure", "no-closure"])
def test_lazy_waits_before_the_update_after_the_closure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        closure: bool) -> None:
    model = torch.nn.Linear(600, 600)  # 1.4 MB: streamed from the live weights, not copied at the call
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 600)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    holds_cm, holds, io = lazy_save_held(tmp_path, monkeypatch, {"state_dict": model.state_dict(),
                                                                 "optimizer_states": [opt.state_dict()]})
    try:
        def step_closure() -> torch.Tensor:
            holds.log.append(("closure", ""))
            opt.zero_grad()
            loss = model(torch.randn(2, 600)).sum()
            loss.backward()
            return loss

        if closure:
            opt.step(step_closure)
        else:
            step_closure()
            opt.step()
        io.teardown()
    finally:
        holds_cm.__exit__(None, None, None)
    assert [why for why, _ in holds.log][:2] == ["closure", "wait_staged"]  # forward and backward overlapped it
    back = StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    for key, t in saved.items():
        assert torch.equal(back["state_dict"][key], t), key
    assert not torch.equal(model.weight, saved["weight"])


def test_lazy_waits_before_a_forward_that_updates_saved_buffers(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    bn = torch.nn.BatchNorm1d(300_000)  # running statistics of 1.2 MB, streamed from the live buffers
    bn(torch.randn(4, 300_000))
    saved = {k: v.clone() for k, v in bn.state_dict().items()}
    holds_cm, holds, io = lazy_save_held(tmp_path, monkeypatch, {"state_dict": bn.state_dict()})
    try:
        bn.eval()
        bn(torch.randn(4, 300_000))  # no update in eval mode: nothing to wait for
        torch.nn.Linear(3, 3).train()(torch.randn(1, 3))  # a module without saved buffers
        assert holds.released() == []
        bn.train()
        bn(torch.randn(4, 300_000))
        assert holds.released() == [("wait_staged", "a.ckpt")]
        io.teardown()
    finally:
        holds_cm.__exit__(None, None, None)
    back = StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    for key, t in saved.items():
        assert torch.equal(back["state_dict"][key], t), key
    assert bn.running_mean is not None
    assert not torch.equal(bn.running_mean, saved["running_mean"])


def test_lazy_hooks_are_gone_after_teardown(tmp_path: Path) -> None:
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    before = (len(nn_module._global_forward_pre_hooks), len(optim_module._global_optimizer_pre_hooks))
    io = StreamCheckpointIO("lazy")
    io.save_checkpoint({"w": torch.randn(300_000)}, tmp_path / "a.ckpt")
    io.teardown()
    assert (len(nn_module._global_forward_pre_hooks), len(optim_module._global_optimizer_pre_hooks)) == before


# --- imports ------------------------------------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=child_env(), check=False)


def test_import_ckptstream_does_not_import_lightning() -> None:
    done = run_python("import sys, ckptstream, ckptstream.dcp; print(sorted(m for m in sys.modules "
                      "if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric')))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_without_lightning_the_import_says_how_to_install() -> None:
    done = run_python("import sys; sys.modules['lightning'] = None\nimport ckptstream.lightning")
    assert done.returncode == 1
    assert "ImportError: ckptstream.lightning needs Lightning" in done.stderr
    assert "pip install 'ckptstream[lightning]'" in done.stderr
