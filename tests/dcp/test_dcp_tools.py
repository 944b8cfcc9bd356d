"""DCP's own tools on checkpoints of ``StreamWriter``, in one process (test_dcp_ranks runs the
same on a checkpoint of two ranks): what works, what cannot, and ckptstream's equivalents.

- torch's ``FileSystemReader`` (and so ``format_utils.dcp_to_torch_save``) torch.loads every
  chunk, and ours are raw bytes: it is refused with an error that says what to use instead;
- ``ckptstream.dcp.dcp_to_torch_save`` converts, bit for bit, and publishes atomically;
- ``format_utils.torch_save_to_dcp`` has no storage-writer argument: its two lines, with
  ``StreamWriter``, make a checkpoint of ours.
"""

from __future__ import annotations

import datetime
import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstream
import ckptstream.dcp
from tests.dcp.dcp_helpers import (
    assert_same,
    edge_state,
    fresh_destination,
    load_1,
    raises_in_dcp,
    save_1,
    single_process,
    torch_version,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
READS_DESCRIPTORS = torch_version() >= (2, 7)  # FileSystemReader asks each record for its transforms
REFUSAL = r"saved by ckptstream\.dcp\.StreamWriter, whose chunks are raw tensor bytes .*ckptstream\.dcp\.dcp_to"


def test_dcp_to_torch_save_is_bit_exact(tmp_path: Path) -> None:
    state = edge_state()
    save_1(state, tmp_path / "ckpt")
    ckptstream.dcp.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "state.pt")
    assert_same(torch.load(tmp_path / "state.pt", weights_only=True), state)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "state.pt"]  # published: no temp left


def test_dcp_to_torch_save_raises_the_readers_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \.metadata"):
        ckptstream.dcp.dcp_to_torch_save(tmp_path / "none", tmp_path / "state.pt")
    save_1({"w": torch.randn(4), "day": datetime.date(2024, 9, 17)}, tmp_path / "ckpt")
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"the non-tensor value 'day' refers to datetime\.date"):
        ckptstream.dcp.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "state.pt")
    assert not (tmp_path / "state.pt").exists()
    ckptstream.dcp.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "state.pt", trust_metadata=True)
    assert torch.load(tmp_path / "state.pt", weights_only=False)["day"].year == 2024


@pytest.mark.skipif(not READS_DESCRIPTORS, reason="FileSystemReader before torch 2.7 torch.loads the raw bytes")
def test_torch_format_utils_dcp_to_torch_save_is_refused_clearly(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    save_1(edge_state(), tmp_path / "ckpt")
    raises_in_dcp(ckptstream.UnsupportedTypeError, REFUSAL, dcp_to_torch_save, tmp_path / "ckpt",
                  tmp_path / "state.pt")
    assert not (tmp_path / "state.pt").exists()


@pytest.mark.skipif(not READS_DESCRIPTORS, reason="FileSystemReader before torch 2.7 torch.loads the raw bytes")
def test_torch_filesystem_reader_is_refused_clearly(tmp_path: Path) -> None:
    save_1({"w": torch.randn(8)}, tmp_path / "ckpt")
    raises_in_dcp(ckptstream.UnsupportedTypeError, "^rank-00000.safetensors: this checkpoint was saved by "
                  "ckptstream.dcp.StreamWriter", single_process, dcp.load, {"w": torch.zeros(8)},
                  storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"))


def test_empty_state_dict_planner_loads_through_stream_reader(tmp_path: Path) -> None:
    """DCP's _EmptyStateDictLoadPlanner (what dcp_to_torch_save uses) rebuilds the whole state
    from the metadata: every tensor and value, nested as saved."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state = edge_state()
    save_1(state, tmp_path / "ckpt")
    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=ckptstream.dcp.StreamReader(tmp_path / "ckpt"),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_same(loaded, state)
    if "keys" in inspect.signature(_EmptyStateDictLoadPlanner).parameters:
        some: dict[str, Any] = {}
        _load_state_dict(some, storage_reader=ckptstream.dcp.StreamReader(tmp_path / "ckpt"),
                         planner=_EmptyStateDictLoadPlanner(keys={"model.w", "extra"}), no_dist=True)
        assert_same(some, {"model": {"w": state["model"]["w"]}, "extra": state["extra"]})


def test_torch_save_to_dcp_in_two_lines(tmp_path: Path) -> None:
    """format_utils.torch_save_to_dcp always writes with FileSystemWriter; its two lines with
    StreamWriter make a checkpoint of ours."""
    state = edge_state()
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    single_process(dcp.save, loaded, storage_writer=ckptstream.dcp.StreamWriter(tmp_path / "ckpt"))
    assert_same(load_1(fresh_destination(state), tmp_path / "ckpt"), state)
