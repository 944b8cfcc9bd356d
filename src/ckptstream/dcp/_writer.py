"""``StreamWriter``: a ``torch.distributed.checkpoint`` storage writer that streams each rank's
chunks straight from device memory into one safetensors file per rank.

DCP calls, in order: ``reset`` (with a checkpoint_id) -> ``set_up_storage_writer`` ->
``prepare_local_plan`` -> the coordinator's ``prepare_global_plan`` -> ``write_data`` on every
rank -> the coordinator's ``finish`` with every rank's results. Each rank's ``write_data``
publishes its file (fsync, rename, directory fsync) before returning its results, so when
``finish`` runs every rank file is durable; ``finish`` then writes ``.metadata`` atomically.
The coordinator removes an old ``.metadata`` before any rank writes, so a save into a used
directory that fails half-way leaves no checkpoint there rather than a mix of two.

The writer is also the ``AsyncStager`` of ``dcp.async_save`` (an explicit subclass, which
torch 2.9+ needs to recognise it; torch 2.4-2.8 ask the writer itself to stage).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import uuid
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._checkpoint.capture import AsyncMode, Captured
from .._checkpoint.guard import HostCopies
from .._engine import Mark, mark
from .._settings import Settings, per_call
from .._storage import storage_for
from . import _metadata, _rankfile, _staging


class StreamWriter(_metadata.CheckpointDirectory, StorageWriter, AsyncStager):
    """Save a DCP checkpoint into the directory ``path``: one safetensors file per rank
    (``rank-00000.safetensors``, ...), streamed from the tensors' memory (GPU or CPU) through a
    few pinned buffers, with a CRC-32C per chunk, and DCP's ``.metadata`` written last.

    Args:
        path: the checkpoint's directory (created if missing), or the URL of a folder of any
            registered storage (``s3://bucket/run/step-100``); ``dcp.save(...,
            checkpoint_id=...)`` replaces it.
        mode: what ``dcp.async_save`` saves in the background (``ckptstream.AsyncMode``, the
            modes of ``save_async``): "device" (default: a snapshot on the tensors' own
            devices), "lazy" (no copy; call ``wait_staged()`` before changing the state) or
            "host" (a full host copy, as DCP's own stager). Unused by ``dcp.save``.
        checksum: store a CRC-32C of every chunk (``StreamReader`` verifies chunks read whole).
        settings: the ``Settings`` of this writer's transfers (a complete value); None: those
            in force when the writer is made (see ``ckptstream.settings``).

    Example:
        >>> dcp.save(state_dict, storage_writer=ckptstream.dcp.StreamWriter("ckpt/step-100"))
    """

    _synchronize_after_execute = False  # DCP need not wait: see wait_staged()

    def __init__(self, path: str | os.PathLike[str], *, mode: AsyncMode | str = "device", checksum: bool = True,
                 settings: Settings | None = None) -> None:
        super().__init__()
        self.path = _metadata.checkpoint_folder(path)
        self.mode = AsyncMode.parse(mode)
        self.checksum = checksum
        self.cfg = per_call("StreamWriter", settings, {})
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True
        self.save_id = str(uuid.uuid4())
        self._staged = threading.Event()
        self._staged.set()
        self._captured: tuple[int, Captured] | None = None  # (staging thread, capture) of the last stage()
        self._copies: HostCopies | None = None  # "host": the last stage()'s copies, on side streams
        self._planning = _PlanningPause()
        weakref.finalize(self, self._planning.end)

    # --- planning ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._planning.end()  # a save whose planning failed never got to write_data
        if checkpoint_id:
            self.path = _metadata.checkpoint_folder(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # torch 2.9+ passes rank= and use_collectives= (to signatures with **kwargs); before, the
        # plan index, which equals the rank there, names the file
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._planning.start()  # DCP plans next (see _PlanningPause); write_data or finish ends it

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _rankfile.check_items(plan.items)
        storage_for(self.path).make_folders(self.path)
        if self.rank is None:
            return plan
        if not self.use_collectives:  # this rank's own metadata, written last again
            _remove_durably(self.path, [_metadata.metadata_name(self.rank)])
        return dataclasses.replace(plan, storage_data=_rankfile.rank_file_name(self.rank))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = [p if isinstance(p.storage_data, str) else
                 dataclasses.replace(p, storage_data=_rankfile.rank_file_name(i)) for i, p in enumerate(plans)]
        if self.use_collectives:  # the coordinator's view of the whole save (without: each rank's own)
            # no rank writes before this returns: an old checkpoint here stops being one first,
            # durably (a crash that kept a new rank file must not bring its old .metadata back)
            _remove_durably(self.path, [_metadata.METADATA_NAME])
            _rankfile.remove_leftovers(self.path, keep={p.storage_data for p in plans})
        return plans

    # --- writing -------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        finally:
            self._staged.set()  # also when it failed: nobody waits for ever
            if self.use_collectives and not self.is_coordinator:  # finish runs on the coordinator only
                self._planning.end()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        name = plan.storage_data
        if not isinstance(name, str):
            raise RuntimeError("StreamWriter.write_data: the plan has no file name; DCP calls prepare_local_plan / "
                               "prepare_global_plan first (pass the writer to dcp.save or dcp.async_save)")
        items = plan.items
        # non-tensor values first: their sizes are in the header
        blobs = {i: _rankfile.blob_tensor(planner.resolve_data(item), item.index.fqn)
                 for i, item in enumerate(items) if item.type == WriteItemType.BYTE_IO}
        rank_file = _rankfile.RankFile.plan(name, items, {i: b.numel() for i, b in blobs.items()}, self.checksum)
        tensors = [blobs[i] if i in blobs else _rankfile.chunk_tensor(planner.resolve_data(items[i]), items[i])
                   for i in rank_file.item_of]
        after = self._ordering(tensors)
        chunks = rank_file.write(self.path, tensors, self.cfg, after=after, copied=self._staged.set)
        return [WriteResult(index=items[i].index, size_in_bytes=chunk.length, storage_data=chunk)
                for i, chunk in zip(rank_file.item_of, chunks, strict=True)]

    def _ordering(self, tensors: list[torch.Tensor]) -> Mark | None:
        """The point of the CUDA streams that the copies follow: in an async save, the one
        taken when the state was staged, in the caller's thread (this one runs in DCP's), once
        a host snapshot's copies are done; otherwise None: the engine takes this thread's
        current streams."""
        staged, self._captured = self._captured, None
        if staged is None:
            return None
        thread, captured = staged
        captured.copied()  # the host snapshot's copies, before the engine reads it
        if thread == threading.get_ident() or captured.after is None:
            return None
        after = mark(tensors)  # devices the snapshot did not hold (a planner's own tensors)
        after.update(captured.after)
        return after

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            self._planning.end()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        fields = {f.name for f in dataclasses.fields(metadata)}
        if "version" in fields:  # torch 2.5+
            metadata.version = _metadata.FORMAT_VERSION
        if "storage_meta" in fields:
            metadata.storage_meta = self.storage_meta()
        _metadata.write_metadata(self.path, metadata, None if self.use_collectives else self.rank)

    def storage_meta(self) -> Any:
        try:
            from torch.distributed.checkpoint.metadata import StorageMeta
        except ImportError:  # torch without it: DCP passes None
            return None
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    # --- async staging -------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict that ``dcp.async_save`` saves in the background (see ``mode``)."""
        staged, captured = _staging.stage(state_dict, self.mode)
        if not captured.staged:
            self._staged.clear()
        self._captured = threading.get_ident(), captured
        self._copies = captured.copies
        return staged

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Make the state given to ``dcp.async_save`` safe to change: at once with "device";
        with "host", at once, once the current stream of each device waits for the copies into
        host memory (work queued on it from now on runs after them); with "lazy", once this
        rank's write has copied every tensor's bytes out (or failed). Returns False if
        ``timeout`` seconds passed first. A save that fails before it writes (in DCP's planning)
        does not get here: its future holds the error."""
        copies = self._copies
        if copies is not None and not copies.done():
            copies.order()
            return True
        return self._staged.wait(timeout)

    def synchronize_staging(self) -> None:
        self.wait_staged()

    def close(self) -> None:
        """Nothing to release (torch 2.9+ calls it on stagers it made)."""

    def __getstate__(self) -> dict[str, Any]:
        """DCP's process executor pickles the writer: without its event and CUDA ordering point,
        which belong to this process."""
        state = dict(self.__dict__)
        state["_staged"], state["_captured"], state["_planning"], state["_copies"] = None, None, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._staged = threading.Event()
        self._staged.set()
        self._planning = _PlanningPause()
        weakref.finalize(self, self._planning.end)


class _PlanningPause:
    """The process's objects set aside from Python's cyclic collector (``gc.freeze``) while DCP
    plans a save and exchanges its plans and results: from ``set_up_storage_writer`` to the end
    of ``write_data`` on every rank but the coordinator, to the end of ``finish`` on it. Planning
    makes a few objects per chunk on every rank, and with several ranks the coordinator
    unpickles every rank's plan and then every rank's results (the others the global plan):
    thousands of objects at once, which start full collections, and a full collection scans
    every object of the process (a training job's millions). Frozen, those are not scanned,
    while the save's own objects are collected as usual.

    A save that fails before that end (in planning, or a write on another rank) never reaches
    it: the writer's next ``reset`` (the next save or load with it) or its end thaws them; until
    then a cycle among the objects that were frozen is not collected (nothing else is held
    back). A process that froze objects itself (``gc.get_freeze_count()`` not 0) is left alone."""

    def __init__(self) -> None:
        self._frozen = False

    def start(self) -> None:
        if not self._frozen and gc.get_freeze_count() == 0:
            gc.freeze()
            self._frozen = True

    def end(self) -> None:
        if self._frozen:
            self._frozen = False
            gc.unfreeze()


def _remove_durably(directory: str, names: list[str]) -> None:
    """Unlink ``names`` from ``directory`` and fsync it, so that the removal is on disk before
    any file of the new save is."""
    storage = storage_for(directory)
    removed = False
    for name in names:
        path = storage.join(directory, name)
        if storage.exists(path):
            storage.remove(path, missing_ok=True)
            removed = True
    if removed:
        storage.sync_folder(directory)
