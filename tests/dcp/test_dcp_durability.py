"""Durability of ``dcp.save`` with ``StreamWriter``, shown on the real calls it makes (the
tracing of tests/reliability/test_durability.py, with unlinks recorded too): on a save into a
used directory the old ``.metadata`` is unlinked and the directory fsynced before any rank file
is written; each rank file is written to a temp, fsynced, renamed and the directory fsynced;
only then is the ``.metadata`` temp written, fsynced, renamed and the directory fsynced; neither
is ever written in place. (test_dcp_ranks: a re-save of a complete directory in which one of
two gloo ranks fails leaves no ``.metadata`` beside the other rank's new file.)"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstream._storage import publish
from tests.dcp.dcp_helpers import load_1, poisoned_like, same_bits, save_1
from tests.reliability.test_durability import OPTS, Trace, temps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
RANK0 = "rank-00000.safetensors"


class UnlinkTrace(Trace):
    """Trace, with every unlink recorded as ("unlink", path)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch)
        real: Callable[..., None] = os.unlink
        lock = threading.Lock()

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            real(path, *args, **kwargs)
            with lock:
                self.events.append(("unlink", os.path.abspath(os.fsdecode(path))))

        monkeypatch.setattr(os, "unlink", unlink)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(301, 257, generator=g), "b": torch.randn(4099, generator=g).to(torch.bfloat16),
            "step": seed}


def publish_steps(events: list[tuple[Any, ...]], target: str) -> dict[str, int]:
    """Where the temp of ``target`` was created, last written, fsynced and renamed over it, and
    the directory fsynced after; checks that nothing wrote the target itself."""
    directory = os.path.dirname(target)
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == target]
    assert len(renames) == 1, f"{target} renamed into place {len(renames)} times"
    rename = renames[0]
    temp = events[rename][1]
    assert os.path.dirname(temp) == directory
    assert publish.TEMP_MARK in temp
    assert not [e for e in events if e[0] in ("write", "truncate") and e[1] == target], f"{target} written in place"
    assert not [e for e in events if e[0] == "open" and e[1] == target and e[2] & (os.O_WRONLY | os.O_RDWR)], \
        f"{target} opened for writing"
    created = min(i for i, e in enumerate(events) if e[0] == "open" and e[1] == temp)
    writes = [i for i, e in enumerate(events) if e[0] in ("write", "truncate") and e[1] == temp]
    syncs = [i for i, e in enumerate(events) if e == ("sync", temp) and i < rename]
    assert writes, f"{temp} never written"
    assert syncs, f"{temp} not fsynced before its rename"
    assert writes[-1] < syncs[-1], f"{temp} written after its last fsync"
    dir_syncs = [i for i, e in enumerate(events) if e == ("sync", directory) and i > rename]
    assert dir_syncs, f"the directory is not fsynced after {target} is renamed into place"
    return {"created": created, "renamed": rename, "dir_synced": dir_syncs[0]}


def test_dcp_save_unlinks_old_metadata_then_publishes_rank_files_then_metadata(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    save_1(state(1), ckpt)
    directory = os.path.realpath(ckpt)
    metadata, rank_file = os.path.join(directory, ".metadata"), os.path.join(directory, RANK0)
    trace = UnlinkTrace(monkeypatch)
    save_1(state(2), ckpt, settings=OPTS)
    monkeypatch.undo()
    events = trace.events
    removed = [i for i, e in enumerate(events) if e == ("unlink", metadata)]
    assert removed, "the old .metadata was not removed"
    removal_synced = [i for i, e in enumerate(events) if e == ("sync", directory) and i > removed[0]]
    assert removal_synced, "the directory is not fsynced after the old .metadata is removed"
    rank = publish_steps(events, rank_file)
    assert removal_synced[0] < rank["created"], "a rank file is written before the old .metadata's removal is durable"
    meta = publish_steps(events, metadata)
    assert rank["dir_synced"] < meta["created"], ".metadata is written before the rank file is durable"
    assert temps(ckpt) == []
    loaded = load_1({"w": poisoned_like(state(2)["w"]), "b": poisoned_like(state(2)["b"]), "step": 0}, ckpt)
    assert same_bits(loaded["w"], state(2)["w"])
    assert same_bits(loaded["b"], state(2)["b"])
    assert loaded["step"] == 2

