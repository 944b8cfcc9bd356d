"""Crafted pickles in a DCP checkpoint run no code: ``.metadata`` payloads (an allowed module's
``os``, ``eval``/``exec``/``getattr`` chains, hostile arguments and states for the allowed
classes, GLOBAL / STACK_GLOBAL / INST / OBJ / NEWOBJ / EXT opcodes, a tuple nest that crashes
Python's unpicklers), non-tensor values that are hostile ``torch.save`` bytes, and a seeded fuzz
of pickle opcodes. Each runs in child_pickles.py under an audit hook that records and stops any
process start, file write or removal, code run from text or global resolved by Python's own
unpicklers; each payload also tries to create a sentinel file. Every one must be refused with
CorruptCheckpointError naming the file and what it names, through ``read_metadata``,
``checkpoint_files()`` and ``dcp.load(..., StreamReader(...), no_dist=True)``.

Then what real checkpoints hold still loads: the .metadata of StreamWriter and of torch's
FileSystemWriter on this torch, non-tensor values of every plain kind, and other objects behind
``trust_metadata=True``."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptstream
import ckptstream.dcp
from ckptstream.dcp import _metadata, _pickles
from tests.dcp.dcp_helpers import (
    HERE,
    load_1,
    raises_in_dcp,
    raises_metadata_error,
    same_bits,
    save_1,
    single_process,
    worker_env,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CHILD = HERE / "child_pickles.py"
DCP_MD = "torch.distributed.checkpoint.metadata"

# --- a small pickle assembler ----------------------------------------------------------------------

PROTO, STOP, MARK, REDUCE, BUILD, NEWOBJ, NEWOBJ_EX = b"\x80\x04", b".", b"(", b"R", b"b", b"\x81", b"\x92"
TUPLE1, TUPLE2, EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST, NONE = b"\x85", b"\x86", b")", b"}", b"]", b"N"
SETITEM, APPEND, ADDITEMS, BINPERSID, OBJ = b"s", b"a", b"\x90", b"Q", b"o"


def text(s: str) -> bytes:
    raw = s.encode()
    return (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little")) + raw


def glob(module: str, name: str) -> bytes:
    """GLOBAL (protocol 0's text form)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def sglob(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4)."""
    return text(module) + text(name) + b"\x93"


def small(n: int) -> bytes:
    return b"K" + bytes([n])


def call(fn: bytes, *args: bytes) -> bytes:
    return fn + MARK + b"".join(args) + b"t" + REDUCE


def pickled(*ops: bytes) -> bytes:
    return PROTO + b"".join(ops) + STOP


class Reduces:
    """Pickles as ``fn(*args)``: a payload made by pickle itself (dumping it runs nothing)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


# --- the checkpoints the payloads go into ----------------------------------------------------------

def base_state() -> dict[str, Any]:
    return {"w": torch.randn(64, 5), "extra": {"step": 3}}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base") / "ckpt"
    save_1(base_state(), path)
    return path


def metadata_payloads(sentinel: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (.metadata bytes, what the refusal must name)."""
    touch, code = f"touch {sentinel}", f"open({str(sentinel)!r}, 'w').close()"
    evil_metadata = _real_metadata()  # a real checkpoint's, with something hostile inside
    evil_metadata.planner_data["w"] = Reduces(eval, code)
    return {
        "an allowed module's os": (pickled(call(sglob(DCP_MD, "os.system"), text(touch))), f"{DCP_MD}.os.system"),
        "an allowed module's os module": (pickled(sglob(DCP_MD, "os"), text("system"), TUPLE2), f"{DCP_MD}.os"),
        "posix.system": (pickled(call(glob("posix", "system"), text(touch))), "posix.system"),
        "os.system as pickle writes it": (pickle.dumps(Reduces(os.system, touch)), "posix.system"),
        "builtins.eval": (pickled(call(glob("builtins", "eval"), text(code))), "builtins.eval"),
        "eval by its Python 2 name": (pickled(call(glob("__builtin__", "eval"), text(code))), "__builtin__.eval"),
        "builtins.exec": (pickled(call(sglob("builtins", "exec"), text(code))), "builtins.exec"),
        "getattr of a module": (pickled(call(sglob("builtins", "getattr"), sglob("torch", "serialization"),
                                             text("os"))), "builtins.getattr"),
        "a dotted chain through torch": (pickled(call(sglob("torch", "serialization.os.system"), text(touch))),
                                         "torch.serialization.os.system"),
        "a dotted chain to a class's globals": (pickled(sglob(DCP_MD, "Metadata.__init__.__globals__")),
                                                f"{DCP_MD}.Metadata.__init__.__globals__"),
        "a dotted chain through ckptstream": (pickled(call(sglob("ckptstream.dcp", "_metadata.os.system"),
                                                           text(touch))), "ckptstream.dcp._metadata.os.system"),
        "subprocess.Popen": (pickled(call(sglob("subprocess", "Popen"), EMPTY_LIST + text("touch") + APPEND
                                          + text(str(sentinel)) + APPEND)), "subprocess.Popen"),
        "torch.load": (pickled(call(sglob("torch", "load"), text(str(sentinel)))), "torch.load"),
        "a nested pickle.loads": (pickled(call(sglob("pickle", "loads"), b"C" + bytes([40]) + b"x" * 40)),
                                  "pickle.loads"),
        "eval inside real metadata": (pickle.dumps(evil_metadata), "builtins.eval"),
        "a global deep in containers": (pickled(EMPTY_DICT, text("k"), EMPTY_LIST, EMPTY_LIST,
                                                call(glob("os", "system"), text(touch)), APPEND, APPEND, SETITEM),
                                        "os.system"),
        "torch.Size given a command": (pickled(call(sglob("torch", "Size"), text(touch))), "torch.Size wrongly"),
        "_get_layout given code": (pickled(call(sglob("torch.serialization", "_get_layout"), text(code))),
                                   "torch.serialization._get_layout wrongly"),
        "a dataclass called": (pickled(call(sglob(DCP_MD, "Metadata"), text(touch))),
                               f"calls {DCP_MD}.Metadata, which it makes from its fields"),
        "the enum's functional API": (pickled(call(sglob(DCP_MD, "_MEM_FORMAT_ENCODING"), text("X"),
                                                   EMPTY_LIST)), f"calls {DCP_MD}._MEM_FORMAT_ENCODING wrongly"),
        "state set on a class": (pickled(sglob(DCP_MD, "Metadata"), NONE, EMPTY_DICT, text("__eq__"),
                                         sglob("torch", "Size"), SETITEM, TUPLE2, BUILD),
                                 f"sets the state of the class {DCP_MD}.Metadata"),
        "state set on an enum member": (pickled(call(sglob(DCP_MD, "_MEM_FORMAT_ENCODING"), small(0)), EMPTY_DICT,
                                                text("_value_"), small(5), SETITEM, BUILD),
                                        "sets the state of an object of torch.distributed.checkpoint.metadata."
                                        "_MEM_FORMAT_ENCODING"),
        "state set on a dtype": (pickled(sglob("torch", "float32"), EMPTY_DICT, BUILD),
                                 "sets the state of an object of torch.float32"),
        "a slot state": (pickled(sglob("ckptstream.dcp", "StoredChunk"), EMPTY_TUPLE, NEWOBJ, NONE, EMPTY_DICT,
                                 text("relative_path"), text("x"), SETITEM, TUPLE2, BUILD),
                         "gives a ckptstream.dcp.StoredChunk a state that is not a dict of its fields"),
        "a dunder in a state": (pickled(sglob("ckptstream.dcp", "StoredChunk"), EMPTY_TUPLE, NEWOBJ, EMPTY_DICT,
                                        text("__class__"), sglob("torch", "Size"), SETITEM, BUILD),
                                "gives a ckptstream.dcp.StoredChunk a state that is not a dict of its fields"),
        "a state TensorProperties refuses": (pickled(sglob(DCP_MD, "TensorProperties"), EMPTY_TUPLE, NEWOBJ,
                                                     MARK, text(touch), b"t", BUILD),
                                             f"gives a {DCP_MD}.TensorProperties a state it refuses"),
        "NEWOBJ with arguments": (pickled(sglob("ckptstream.dcp", "StoredChunk"), text(touch), TUPLE1, NEWOBJ),
                                  "makes a ckptstream.dcp.StoredChunk from arguments"),
        "NEWOBJ_EX with keywords": (pickled(sglob("ckptstream.dcp", "StoredChunk"), EMPTY_TUPLE, EMPTY_DICT,
                                            text("relative_path"), text("../x"), SETITEM, NEWOBJ_EX),
                                    "makes a ckptstream.dcp.StoredChunk from arguments"),
        "NEWOBJ of a function's result": (pickled(sglob("torch", "Size"), EMPTY_TUPLE, NEWOBJ),
                                          "makes an object of torch.Size, which it never holds"),
        "INST of os.system": (pickled(MARK, text(touch), b"i" + b"os\nsystem\n"), "os.system by the INST opcode"),
        "OBJ of an allowed class": (pickled(MARK, sglob(DCP_MD, "Metadata"), OBJ),
                                    f"{DCP_MD}.Metadata by the OBJ opcode"),
        "OBJ of os.system": (pickled(MARK, glob("os", "system"), text(touch), OBJ), "os.system"),
        "EXT2 registered as os.system": (pickled(call(b"\x83" + (0x7A11).to_bytes(2, "little"), text(touch))),
                                         "os.system"),
        "an unregistered EXT1": (pickled(b"\x82\x05"), "refers to the extension code 5, which names nothing"),
        "a persistent id": (pickled(text("storage"), BINPERSID), "refers to a persistent object"),
        "SETITEM on a class": (pickled(sglob(DCP_MD, "Metadata"), text("k"), small(1), SETITEM),
                               f"sets an item of the class {DCP_MD}.Metadata"),
        "APPEND to a function": (pickled(sglob("torch", "Size"), small(1), APPEND), "appends to a torch.Size"),
        "ADDITEMS to a dict": (pickled(EMPTY_DICT, MARK, small(1), ADDITEMS), "adds items to a builtins.dict"),
        "protocol 0 (copyreg)": (pickle.dumps(_real_metadata(), protocol=0), "copy_reg._reconstructor"),
        "tuples nested a million deep": (pickled(EMPTY_DICT, EMPTY_TUPLE, TUPLE1 * 1_000_000, small(1), SETITEM),
                                      "nests tuples more than 64 deep"),
        "a path, not Metadata": (pickle.dumps(Path("/etc/passwd")), "holds a PosixPath, not DCP's Metadata"),
    }


def _real_metadata() -> Any:
    """A StreamWriter checkpoint's Metadata (from a save of base_state in a scratch directory)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        save_1(base_state(), Path(scratch) / "ckpt")
        return _metadata.read_metadata(str(Path(scratch) / "ckpt"), None, trusted=False)


class EvilValueWriter(ckptstream.dcp.StreamWriter):
    """Stores ``bytes_of_step`` as the torch.save bytes of the non-tensor value extra.step."""

    def __init__(self, path: Path, raw: bytes, **options: Any) -> None:
        super().__init__(path, **options)
        self.raw = raw

    def write_data(self, plan: Any, planner: Any) -> Any:
        real = planner.resolve_data

        def resolve(item: Any) -> Any:
            return io.BytesIO(self.raw) if item.index.fqn == "extra.step" else real(item)

        planner.resolve_data = resolve
        return super().write_data(plan, planner)


def torch_saved(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def with_data_pkl(pickles: list[bytes], compress: int = zipfile.ZIP_STORED) -> bytes:
    """torch.save's archive of 1 with its data.pkl replaced by ``pickles`` (several: the same name twice)."""
    source = zipfile.ZipFile(io.BytesIO(torch_saved(1)))
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w") as archive:
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name"
        for info in source.infolist():
            if info.filename.endswith("/data.pkl"):
                for p in pickles:
                    archive.writestr(zipfile.ZipInfo(info.filename), p, compress_type=compress)
            else:
                archive.writestr(info, source.read(info.filename))
    return out.getvalue()


def value_payloads(sentinel: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (torch.save bytes stored as the non-tensor value extra.step, what the refusal names)."""
    touch, code = f"touch {sentinel}", f"open({str(sentinel)!r}, 'w').close()"
    benign = pickle.dumps(7, protocol=2)
    return {
        "value: os.system": (torch_saved(Reduces(os.system, touch)), "refers to posix.system"),
        "value: eval": (torch_saved(Reduces(eval, code)), "refers to __builtin__.eval"),  # protocol 2 names
        "value: a plain pickle, no archive": (pickle.dumps(Reduces(os.system, touch)), "not a torch.save archive"),
        "value: two data.pkl, the second hostile": (with_data_pkl([benign, pickle.dumps(Reduces(eval, code))]),
                                                    "not one uncompressed data.pkl"),
        "value: a compressed data.pkl": (with_data_pkl([benign], zipfile.ZIP_DEFLATED),
                                         "not one uncompressed data.pkl"),
        "value: tuples nested a million deep": (with_data_pkl([pickled(EMPTY_DICT, EMPTY_TUPLE, TUPLE1 * 1_000_000,
                                                                    small(1), SETITEM)]),
                                             "nests tuples more than 64 deep"),
    }


def run_child(*args: str, timeout: float = 300) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(CHILD), *args], env=worker_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_crafted_pickles_are_refused_and_run_nothing(base: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    cases: list[dict[str, Any]] = []
    expected: dict[str, tuple[str, str]] = {}
    for name, (data, names) in metadata_payloads(sentinel).items():
        directory = tmp_path / f"m{len(cases)}"
        shutil.copytree(base, directory)
        (directory / ".metadata").write_bytes(data)
        cases.append({"name": name, "dir": str(directory), "entry_points": ["read", "files", "load"]})
        expected[name] = (str(directory / ".metadata"), names)
    for name, (data, names) in value_payloads(sentinel).items():
        directory = tmp_path / f"v{len(cases)}"
        single_process(dcp.save, base_state(), storage_writer=EvilValueWriter(directory, data))
        cases.append({"name": name, "dir": str(directory), "entry_points": ["load"]})
        expected[name] = (str(directory / ckptstream.dcp.rank_file_name(0)), f"'extra.step' {names}" if
                          names.startswith("refers") or names.startswith("nests") else names)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"warm_up": str(base), "cases": cases}))
    lines = run_child("cases", str(job))
    assert [line["name"] for line in lines] == [c["name"] for c in cases]
    problems = []
    for line in lines:
        path, names = expected[line["name"]]
        if line["events"]:
            problems.append(f"{line['name']}: ran {line['events']}")
        for entry, result in line["results"].items():
            said = result.get("text", "") + "\n".join(result["warnings"])
            if result["raised"] is None or (entry != "load" and not result["corrupt"]):
                problems.append(f"{line['name']} through {entry}: {result}")
            elif path not in said or names not in said:
                problems.append(f"{line['name']} through {entry}: does not name {path} and {names!r}: {said[:2000]}")
    assert problems == []
    assert not sentinel.exists()


@pytest.mark.parametrize("count", [200, pytest.param(600, marks=pytest.mark.slow)], ids=["quick", "soak"])
def test_fuzzed_pickles_are_refused_and_run_nothing(base: Path, tmp_path: Path, count: int) -> None:
    """A seeded fuzz of opcode sequences and of real .metadata spliced and flipped (see
    child_pickles.fuzz): every read ends in the metadata or CorruptCheckpointError naming the
    file; nothing runs."""
    directory = tmp_path / "ckpt"
    shutil.copytree(base, directory)
    lines = run_child("fuzz", str(directory), "20240917", str(count))
    outcomes = lines[-1]["outcomes"]
    assert lines[:-1] == []
    assert set(outcomes) <= {"ok", "corrupt"}, outcomes
    assert outcomes["corrupt"] > 1.5 * count, outcomes  # two reads a payload: most are refused
    assert not (tmp_path / "SENTINEL").exists()


# --- what real checkpoints hold still loads -------------------------------------------------------

def all_dtypes_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {
        "f32": torch.randn(6, 4, generator=g),
        "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "grad": torch.randn(7, generator=g).requires_grad_(),
        **{str(d).split(".")[1]: torch.randint(0, 100, (9,), generator=g).to(d)
           for d in (torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
                     torch.int64, torch.bool)},
    }
    if hasattr(torch, "float8_e5m2"):
        state["f8"] = torch.randn(5, generator=g).to(torch.float8_e5m2)
    return state


PLAIN_VALUES: dict[str, Any] = {
    "int": -(2**70), "float": -0.0, "nan": math.nan, "str": "héllo", "none": None, "true": True, "bytes": b"\x00\xff",
    "bytearray": bytearray(b"ab"), "set": {1, 2}, "frozenset": frozenset({"a"}), "complex": 1.5 - 2j,
    "tuple": (1, (2.5, "x")), "list": [1, [2, None]],
    "ordered": (collections.OrderedDict(b=1, a=2),),  # in a tuple: DCP flattens mappings
    "size": torch.Size([3, 4]), "dtype": torch.bfloat16, "layout": torch.strided,
}


def same_value(a: Any, b: Any) -> bool:
    if isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    if isinstance(b, float):
        return type(a) is float and math.copysign(1, a) == math.copysign(1, b) and a == b
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("writer", ["stream", "filesystem"])
def test_real_metadata_reads_as_plain_pickle_reads_it(tmp_path: Path, writer: str) -> None:
    """The .metadata of StreamWriter and of torch's FileSystemWriter (this torch) holds only what
    the exact set admits: the safe read equals pickle's own."""
    state = {**all_dtypes_state(), "values": dict(PLAIN_VALUES)}
    storage = (ckptstream.dcp.StreamWriter(tmp_path / "ckpt") if writer == "stream"
               else dcp.FileSystemWriter(tmp_path / "ckpt"))
    single_process(dcp.save, state, storage_writer=storage)
    safe = _metadata.read_metadata(str(tmp_path / "ckpt"), None, trusted=False)
    assert safe == pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    cl, grad = safe.state_dict_metadata["cl"], safe.state_dict_metadata["grad"]
    assert isinstance(cl, TensorStorageMetadata)
    assert isinstance(grad, TensorStorageMetadata)
    assert cl.properties.memory_format == torch.contiguous_format
    assert grad.properties.requires_grad is True


def test_plain_non_tensor_values_round_trip(tmp_path: Path) -> None:
    w = torch.randn(3)
    save_1({"w": w, "values": dict(PLAIN_VALUES)}, tmp_path / "ckpt")
    loaded = load_1({"w": torch.zeros(3), "values": dict.fromkeys(PLAIN_VALUES)}, tmp_path / "ckpt")
    assert same_bits(loaded["w"], w)
    for key, value in PLAIN_VALUES.items():
        assert same_value(loaded["values"][key], value), key
    assert type(loaded["values"]["ordered"][0]) is collections.OrderedDict


def test_other_objects_need_trust(tmp_path: Path) -> None:
    """A non-tensor value or planner data of another class is refused, naming the file and the
    class; trust_metadata=True unpickles it as pickle does."""
    day = datetime.date(2024, 9, 17)
    save_1({"w": torch.randn(3), "day": day}, tmp_path / "ckpt")
    rank_file = tmp_path / "ckpt" / ckptstream.dcp.rank_file_name(0)
    raises_in_dcp(ckptstream.CorruptCheckpointError, rf"^{rank_file}: the non-tensor value 'day' refers to "
                  r"datetime\.date", load_1, {"w": torch.zeros(3), "day": None}, tmp_path / "ckpt")
    assert load_1({"w": torch.zeros(3), "day": None}, tmp_path / "ckpt", trust_metadata=True)["day"] == day

    metadata = _metadata.read_metadata(str(tmp_path / "ckpt"), None, trusted=False)
    metadata.planner_data["since"] = day
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    raises_metadata_error(ckptstream.CorruptCheckpointError, r"metadata refers to datetime\.date, which it never "
                          "holds", load_1, {"w": torch.zeros(3)}, tmp_path / "ckpt")
    trusted = _metadata.read_metadata(str(tmp_path / "ckpt"), None, trusted=True)
    assert trusted.planner_data["since"] == day


def test_checkpoints_of_earlier_releases_still_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """StoredChunk pickled under its module's path (ckptstream.dcp._metadata), as before it took
    its public name (ckptstream.dcp), and a FileSystemWriter path pickled by Python 3.13
    (pathlib._local.PosixPath), read as the same objects."""
    save_1({"w": torch.randn(64, 5)}, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / ".metadata"
    metadata = _metadata.read_metadata(str(tmp_path / "ckpt"), None, trusted=False)
    monkeypatch.setattr(ckptstream.dcp.StoredChunk, "__module__", "ckptstream.dcp._metadata")
    old = pickle.dumps(metadata)
    monkeypatch.undo()
    assert b"ckptstream.dcp._metadata" in old
    assert _pickles.loads(old, _metadata.METADATA, str(path), "the metadata") == metadata
    posix = pickled(call(sglob("pathlib._local", "PosixPath"), text("/a/b")))
    assert _pickles.loads(posix, _metadata.METADATA, str(path), "x") == Path("/a/b")


def test_storage_records_carry_their_public_name(tmp_path: Path) -> None:
    chunk = ckptstream.dcp.StoredChunk("rank-00000.safetensors", 4096, 20, "w", 7)
    data = pickle.dumps(chunk)
    assert b"ckptstream.dcp._metadata" not in data
    assert pickle.loads(data) == chunk
    assert dataclasses.replace(chunk, crc=None).crc is None


def test_the_value_tables_hold_values_only() -> None:
    """No module, function or builtin callable among the values; the calls are this package's
    own small functions."""
    import types

    for table in (_metadata.METADATA, _pickles.PLAIN):
        for key, value in table.values.items():
            assert isinstance(value, (torch.dtype, torch.memory_format)), key
        for key, fn in table.calls.items():
            assert isinstance(fn, types.FunctionType), key
            assert fn.__module__ in ("ckptstream.dcp._pickles", "ckptstream.dcp._metadata"), key
        for key, kind in table.classes.items():
            assert isinstance(kind, type), key
            assert dataclasses.is_dataclass(kind), key

