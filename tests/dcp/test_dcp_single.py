"""ckptstream.dcp in one process (DCP without a process group): the rank file's layout, edge-case
tensors, checksums on and off, async staging, refusals before any file, and checkpoints that are
not what their metadata says."""

from __future__ import annotations

import gc
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import ckptstream
import ckptstream.dcp
from ckptstream import Settings
from ckptstream.dcp import StreamReader, StreamWriter
from tests.dcp.dcp_helpers import (
    assert_same,
    edge_state,
    fresh_destination,
    load_1,
    poisoned_like,
    raises_in_dcp,
    same_bits,
    save_1,
    sharding_info,
    single_process,
    worker_env,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SMALL: dict[str, Any] = {"buffer_size": 4096, "num_buffers": 2}  # chunks that cut tensors, and elements, in two


@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "no-checksum"])
def test_round_trip_edge_cases(tmp_path: Path, checksum: bool) -> None:
    state = edge_state()
    save_1(state, tmp_path / "ckpt", checksum=checksum, settings=Settings(**SMALL))
    loaded = load_1(fresh_destination(state), tmp_path / "ckpt", settings=Settings(**SMALL))
    assert_same(loaded, state)
    with ckptstream.open(tmp_path / "ckpt" / "rank-00000.safetensors") as reader:
        assert reader.checksummed is checksum


def test_rank_file_layout(tmp_path: Path) -> None:
    """Keys are DCP's fully-qualified names, every tensor aligned to its element size, the data
    on a 4096-byte boundary, DCP_SHARDING_INFO for every key, readable by safetensors."""
    state = edge_state()
    save_1(state, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "rank-00000.safetensors"]
    path = tmp_path / "ckpt" / "rank-00000.safetensors"
    tensors = {"model.w", "model.bf16", "model.f64", "model.transposed", "model.strided", "model.scalar",
               "model.empty", "int8", "mask", "step"} | ({"fp8"} if "fp8" in state else set())
    values = {"extra.epoch", "extra.name", "extra.sizes", "extra.nothing"}
    assert set(sharding_info(path)) == tensors | values
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == tensors | values
        assert f.metadata()["format"] == "pt"
        for key in tensors:
            head, *rest = key.split(".")
            want = state[head][rest[0]] if rest else state[head]
            assert same_bits(f.get_tensor(key), want), key
        assert torch.load(io.BytesIO(f.get_tensor("extra.sizes").numpy().tobytes()), weights_only=True) == [1, 2, 3]
    with ckptstream.open(path) as reader:
        assert reader.header.data_start % 4096 == 0
        for entry in reader.entries():
            assert entry.offset % entry.dtype.itemsize == 0, entry.key


def test_loads_into_another_dtype(tmp_path: Path) -> None:
    w = torch.randn(40, 7).to(torch.bfloat16)
    save_1({"w": w}, tmp_path / "ckpt")
    loaded = load_1({"w": torch.full((40, 7), float("nan"))}, tmp_path / "ckpt")
    assert same_bits(loaded["w"], w.float())


def _on(state: Any, device: torch.device) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _on(v, device) for k, v in state.items()}
    return state


@pytest.mark.parametrize("mode", ["device", "lazy", "host"])
def test_async_save_stages_then_writes_the_same_file(tmp_path: Path, mode: str, device: torch.device) -> None:
    """Each mode of the one capture, on the CPU and (gpu) on a CUDA device: the state poisoned
    right after staging (after wait_staged in "lazy" and "host" modes), the file equal to a sync save's."""
    state = _on(edge_state(), device)
    want = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state["model"].items()}
    save_1(state, tmp_path / "sync")
    writer = StreamWriter(tmp_path / "async", mode=mode, settings=Settings(**SMALL))
    future = single_process(dcp.async_save, state, storage_writer=writer)
    if mode != "device":  # "host": orders the change below after the copies on a GPU
        assert writer.wait_staged(timeout=60)
    with torch.no_grad():
        for t in state["model"].values():
            t.copy_(poisoned_like(t))
    state["extra"]["epoch"] = 99
    future.result(timeout=60)
    name = "rank-00000.safetensors"
    assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()
    loaded = load_1(fresh_destination(edge_state()), tmp_path / "async")
    assert_same(loaded["model"], want)
    assert loaded["extra"]["epoch"] == 3


def test_writer_and_reader_pickle(tmp_path: Path) -> None:
    """DCP's process executor pickles the writer into another process."""
    writer = pickle.loads(pickle.dumps(StreamWriter(tmp_path / "ckpt", mode="lazy", settings=Settings(**SMALL))))
    assert writer.wait_staged(timeout=0)
    state = {"w": torch.randn(300, 7)}
    single_process(dcp.save, state, storage_writer=writer)
    reader = pickle.loads(pickle.dumps(StreamReader(tmp_path / "ckpt")))
    loaded = {"w": poisoned_like(state["w"])}
    single_process(dcp.load, loaded, storage_reader=reader)
    assert same_bits(loaded["w"], state["w"])


def test_read_slices_verifies_whole_tensors(tmp_path: Path) -> None:
    """What StreamReader relies on: a request for a whole stored tensor is checked against its
    CRC-32C; a box of it cannot be, and reads."""
    w = torch.randn(64, 32)
    path = tmp_path / "w.safetensors"
    ckptstream.save({"w": w, "v": torch.randn(5)}, path)
    with ckptstream.open(path) as reader:
        entry = reader.entry("w")
    with open(path, "r+b") as f:  # one element of the last row
        f.seek(entry.end - 4)
        f.write(b"\x00\x00\xc0\x7f")
    with ckptstream.open(path) as reader:
        assert same_bits(reader.read_slices([("w", [0, 0], [63, 32], "cpu")])[0], w[:63])
        with pytest.raises(ckptstream.CorruptCheckpointError, match=r"tensor 'w' fails its CRC-32C check"):
            reader.read_slices([("w", [0, 0], None, "cpu"), ("v", [0], None, "cpu")])
        assert not same_bits(reader.read_slices([("w", [0], None, "cpu")], checksum=False)[0], w)


def test_the_mode_is_checked() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of \['device', 'lazy', 'host'\], got 'pinned'"):
        StreamWriter("/nonexistent", mode="pinned")
    assert StreamWriter("/nonexistent", mode="lazy").mode is ckptstream.AsyncMode.LAZY
    assert StreamWriter("/nonexistent", mode=ckptstream.AsyncMode.HOST).mode is ckptstream.AsyncMode.HOST


def test_unsupported_dtype_refused_before_any_file(tmp_path: Path) -> None:
    state = {"ok": torch.randn(3), "z": torch.randn(4, dtype=torch.complex128)}
    raises_in_dcp(ckptstream.UnsupportedTypeError, r"^z: dtype torch.complex128 has no safetensors name", save_1,
                  state, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # refused while planning: not even the directory


def test_saving_again_replaces_the_checkpoint(tmp_path: Path) -> None:
    first, second = {"w": torch.randn(64, 5)}, {"w": torch.randn(64, 5)}
    save_1(first, tmp_path / "ckpt")
    save_1(second, tmp_path / "ckpt")
    assert same_bits(load_1({"w": poisoned_like(first["w"])}, tmp_path / "ckpt")["w"], second["w"])


def test_rank_file_of_another_save_is_refused(tmp_path: Path) -> None:
    save_1({"w": torch.randn(64, 5)}, tmp_path / "a")
    save_1({"w": torch.randn(64, 5)}, tmp_path / "b")
    name = "rank-00000.safetensors"
    (tmp_path / "a" / name).write_bytes((tmp_path / "b" / name).read_bytes())
    raises_in_dcp(ckptstream.CorruptCheckpointError, "it is not the file this checkpoint wrote", load_1,
                  {"w": torch.zeros(64, 5)}, tmp_path / "a")


def test_missing_rank_file(tmp_path: Path) -> None:
    save_1({"w": torch.randn(8)}, tmp_path / "ckpt")
    os.unlink(tmp_path / "ckpt" / "rank-00000.safetensors")
    raises_in_dcp(FileNotFoundError, "rank-00000.safetensors", load_1, {"w": torch.zeros(8)}, tmp_path / "ckpt")


@pytest.mark.parametrize("kind", ["tensor", "value", "nested"])
def test_a_state_key_named_like_the_header_table_round_trips(tmp_path: Path, kind: str) -> None:
    """``__metadata__`` is the safetensors header's own key: a chunk of that name is stored
    under another key of the rank file, and loads back under its own."""
    value = {"tensor": torch.randn(7, 3), "value": "a string", "nested": {"a": torch.randn(4), "b": 5}}[kind]
    state = {"__metadata__": value, "w": torch.randn(9)}
    save_1(state, tmp_path / "ckpt")
    blank = {"tensor": poisoned_like(torch.empty(7, 3)), "value": "", "nested": {"a": torch.zeros(4), "b": 0}}
    loaded = load_1({"__metadata__": blank[kind], "w": torch.zeros(9)}, tmp_path / "ckpt")
    assert_same(loaded, state)
    with safe_open(str(tmp_path / "ckpt" / "rank-00000.safetensors"), framework="pt") as f:
        assert "w" in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
        assert "__metadata__" not in f.keys()  # noqa: SIM118


def test_checkpoint_of_torch_filesystem_writer(tmp_path: Path) -> None:
    single_process(dcp.save, {"w": torch.randn(8)}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    raises_in_dcp(ckptstream.CorruptCheckpointError, "load it with .*FileSystemReader", load_1,
                          {"w": torch.zeros(8)}, tmp_path / "ckpt")


def test_checkpoint_files_of_torch_filesystem_writer(tmp_path: Path) -> None:
    single_process(dcp.save, {"w": torch.randn(8)}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    assert ckptstream.dcp.checkpoint_files(tmp_path / "ckpt") == [str(tmp_path / "ckpt" / n)
                                                                  for n in (".metadata", "__0_0.distcp")]


def test_tensor_subclass_messages(tmp_path: Path) -> None:
    class Wrapped(torch.Tensor):
        pass

    with pytest.raises(ckptstream.UnsupportedTypeError, match=r"to_local\(\).*torch\.Tensor\(t\)") as info:
        ckptstream.save({"w": torch.randn(3).as_subclass(Wrapped)}, tmp_path / "x.safetensors")
    assert ".detach()" not in str(info.value)


def test_import_ckptstream_leaves_dcp_alone() -> None:
    code = ("import sys, ckptstream; assert 'torch.distributed.checkpoint' not in sys.modules; "
            "import ckptstream.dcp; assert ckptstream.dcp.StreamWriter")
    subprocess.run([sys.executable, "-c", code], env=worker_env(), check=True)


def test_reader_and_writer_take_checkpoint_id(tmp_path: Path) -> None:
    w = torch.randn(10, 3)
    single_process(dcp.save, {"w": w}, checkpoint_id=tmp_path / "ckpt", storage_writer=StreamWriter(tmp_path / "no"))
    assert not (tmp_path / "no").exists()
    loaded = {"w": poisoned_like(w)}
    single_process(dcp.load, loaded, checkpoint_id=tmp_path / "ckpt", storage_reader=StreamReader(tmp_path / "no"))
    assert same_bits(loaded["w"], w)


class FailingGlobalPlan(dcp.DefaultSavePlanner):
    def create_global_plan(self, plans: Any) -> Any:
        raise RuntimeError("planted planning failure")


class FreezeProbe(dcp.DefaultSavePlanner):
    def create_local_plan(self) -> Any:
        self.frozen = gc.get_freeze_count()
        return super().create_local_plan()


def test_the_process_is_frozen_while_dcp_plans_and_thawed_after(tmp_path: Path) -> None:
    """From the writer's set-up to the end of its finish (of its write, on a rank that is not
    the coordinator) the process's objects are out of the cyclic collector's scans (gc.freeze),
    and in them again after; a save whose planning fails never gets there, so the writer's next
    reset, or its end, thaws them; a process that froze objects itself is left alone."""
    state = {"w": torch.randn(300, 7)}
    assert gc.get_freeze_count() == 0
    writer, probe = StreamWriter(tmp_path / "ckpt"), FreezeProbe()
    single_process(dcp.save, state, storage_writer=writer, planner=probe)
    assert probe.frozen > 0
    assert gc.get_freeze_count() == 0
    raises_in_dcp(RuntimeError, "planted planning failure", single_process, dcp.save, state,
                  storage_writer=writer, planner=FailingGlobalPlan())
    assert gc.get_freeze_count() > 0  # planning failed before the write
    writer.reset()
    assert gc.get_freeze_count() == 0
    raises_in_dcp(RuntimeError, "planted planning failure", single_process, dcp.save, state,
                  storage_writer=StreamWriter(tmp_path / "other"), planner=FailingGlobalPlan())
    gc.collect()  # the writer, held by the failure's traceback until now, is gone: its end thawed them
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the process's own freeze
    try:
        frozen = gc.get_freeze_count()
        probe = FreezeProbe()
        single_process(dcp.save, state, storage_writer=StreamWriter(tmp_path / "ckpt"), planner=probe)
        assert probe.frozen <= frozen  # not frozen again (frozen objects may be freed meanwhile)
        assert gc.get_freeze_count() > 0  # nor thawed
    finally:
        gc.unfreeze()
