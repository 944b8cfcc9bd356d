"""Required checksums: a file whose ``__metadata__`` a tool dropped is a plain safetensors file,
which loads unchecked by default (interop) and is refused with ``require_checksums=True`` by
every way of reading it, and always where ckptstream knows it wrote the file with checksums (a
complete step of a CheckpointManager, a DCP rank file whose metadata records them)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ckptstream
from ckptstream import ChecksumsMissingError, cli
from tests.dcp.dcp_helpers import load_1, raises_in_dcp, save_1
from tests.helpers import as_bytes, random_tensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def strip_metadata(path: Path) -> None:
    """Rewrite the header without ``__metadata__``, in place: the header keeps its length (padded
    with spaces), so the data and the file's size stay as they were."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + n])
    assert "ckptstream.crc32c" in table.pop("__metadata__")
    body = json.dumps(table, separators=(",", ":")).encode()
    raw[8 : 8 + n] = body + b" " * (n - len(body))
    path.write_bytes(bytes(raw))


def flat_state() -> dict[str, torch.Tensor]:
    return {"w": random_tensor((64, 33)), "b": random_tensor(17, torch.bfloat16), "i": random_tensor(9, torch.int64)}


def assert_same(got: dict[str, Any], want: dict[str, torch.Tensor], where: str = "") -> None:
    assert sorted(got) == sorted(want), where
    for key, t in want.items():
        assert (got[key].dtype, got[key].shape) == (t.dtype, t.shape), (where, key)
        assert as_bytes(got[key]) == as_bytes(t), (where, key)


def every_way(path: Path, require: bool) -> dict[str, Any]:
    """Read ``path`` each way; what each gave (a loaded state)."""
    state = flat_state()
    got: dict[str, Any] = {}
    for mmap in (None, False):
        got[f"load mmap={mmap}"] = ckptstream.load(path, mmap=mmap, require_checksums=require)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptstream.load_into(into, path, require_checksums=require)
    got["load_into"] = into
    with ckptstream.open(path, require_checksums=require) as reader:
        got["open"] = {k: reader.read(k) for k in state}
    ckptstream.verify(path, require_checksums=require)
    return got


@pytest.mark.parametrize("how", ["by_hand", "safetensors"])
def test_file_without_checksums_is_refused_every_way(tmp_path: Path, how: str) -> None:
    state = flat_state()
    path = tmp_path / "model.safetensors"
    ckptstream.save(state, path)
    for way, got in every_way(path, require=True).items():  # saved with checksums: accepted
        assert_same(got, state, way)
    if how == "by_hand":
        strip_metadata(path)
    else:  # what a tool that copies a file through safetensors writes
        safetensors.torch.save_file(safetensors.torch.load_file(str(path)), str(path))
    for way, got in every_way(path, require=False).items():  # interop: loads, unchecked
        assert_same(got, state, way)
    with ckptstream.open(path) as reader:
        assert not reader.checksummed
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    calls = {
        "load": lambda: ckptstream.load(path, require_checksums=True),
        "load mmap=False": lambda: ckptstream.load(path, mmap=False, require_checksums=True),
        "load meta": lambda: ckptstream.load(path, device="meta", require_checksums=True),
        "load_into": lambda: ckptstream.load_into(into, path, require_checksums=True),
        "open": lambda: ckptstream.open(path, require_checksums=True),
        "verify": lambda: ckptstream.verify(path, require_checksums=True),
    }
    for way, call in calls.items():
        with pytest.raises(ChecksumsMissingError, match="holds no checksums") as e:
            call()
        assert str(e.value).startswith(f"{path}: "), way
        assert "require_checksums=False" in str(e.value), way
        assert isinstance(e.value, ckptstream.CorruptCheckpointError), way
    assert all(not t.any() for t in into.values())  # refused before a byte was written


def test_cli_verify_require_checksums(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.safetensors"
    ckptstream.save(flat_state(), path)
    assert cli.main(["verify", "--require-checksums", str(path)]) == 0
    assert "checksums verified" in capsys.readouterr().out
    strip_metadata(path)
    assert cli.main(["verify", str(path)]) == 0
    assert "structure only: the file has no checksums" in capsys.readouterr().out
    assert cli.main(["verify", "--require-checksums", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"ckptstream verify: {path}: holds no checksums" in err


def test_manager_refuses_a_step_file_that_lost_its_checksums(tmp_path: Path) -> None:
    model = flat_state()
    state: dict[str, Any] = {"model": model, "step": 10}
    with ckptstream.CheckpointManager(tmp_path / "ckpts") as ckpts:
        ckpts.save(state, 10, blocking=True)
        ckpts.save({**state, "step": 20}, 20, blocking=True)
    reader = ckptstream.CheckpointManager(tmp_path / "ckpts")
    assert_same(reader.load(20)["model"], model)
    file = Path(reader.path(20))
    strip_metadata(file)
    assert reader.steps() == [10, 20]  # DONE's record (names, sizes) still holds
    fresh: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "step": 0}
    for call in (lambda: reader.load(), lambda: reader.load(mmap=False), lambda: reader.load_into(fresh)):
        with pytest.raises(ChecksumsMissingError, match="DONE marker") as e:
            call()
        assert str(e.value).startswith(f"{file}: holds no checksums")
        assert "checksum=False" in str(e.value)
        assert isinstance(e.value.__cause__, ChecksumsMissingError)
    assert all(not t.any() for t in fresh["model"].values())
    assert_same(reader.load(10)["model"], model)  # the other step is intact
    # read unchecked, on request: a plain safetensors file now, whose keys are the tensors' names
    flat = {f"model.{k}": v for k, v in model.items()}
    assert_same(reader.load(checksum=False), flat)
    assert_same(ckptstream.CheckpointManager(tmp_path / "ckpts", checksum=False).load(), flat)


def test_manager_without_checksums_loads_its_files(tmp_path: Path) -> None:
    model = flat_state()
    with ckptstream.CheckpointManager(tmp_path / "ckpts", checksum=False) as ckpts:
        ckpts.save({"model": model, "step": 3}, 3, blocking=True)
        assert_same(ckpts.load()["model"], model)


def test_dcp_refuses_a_rank_file_that_lost_its_checksums(tmp_path: Path) -> None:
    state = {"model": flat_state()}
    save_1(state, tmp_path / "ckpt")
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    assert_same(load_1(fresh, tmp_path / "ckpt")["model"], state["model"])
    file = tmp_path / "ckpt" / "rank-00000.safetensors"
    strip_metadata(file)
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    error = raises_in_dcp(ChecksumsMissingError, "records a CRC-32C", load_1, fresh, tmp_path / "ckpt")
    assert str(error).startswith(f"{file}: holds no checksums")
    assert "StreamReader(checksum=False)" in str(error)
    assert all(not t.any() for t in fresh["model"].values())
    assert_same(load_1(fresh, tmp_path / "ckpt", checksum=False)["model"], state["model"])
