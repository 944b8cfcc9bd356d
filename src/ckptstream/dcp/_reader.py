"""``StreamReader``: a ``torch.distributed.checkpoint`` storage reader for checkpoints that
``StreamWriter`` wrote.

DCP's planner decides which box of which saved chunk lands in which box of which destination
tensor (that is resharding: a chunk saved by one rank may feed several ranks, a destination may
gather several chunks). ``read_data`` groups this rank's read items by file and reads each file
in one pass (``CheckpointReader.read_slices``), sorted by offset: only the boxes' bytes are read,
straight into the destinations on their own devices (narrowed, often non-contiguous views).
A chunk read whole is compared with its CRC-32C. Non-tensor values come back through
``planner.load_bytes``, which unpickles them (DCP's planner with ``weights_only=False``): they
are read with ``_pickles.plain_value`` first, and the planner gets bytes made from plain data.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._checkpoint.reader import CheckpointReader, TensorEntry
from .._engine.tensor_bytes import host_bytes
from .._errors import ChecksumsMissingError, CorruptCheckpointError
from .._settings import Settings, per_call
from .._storage import storage_for
from . import _metadata, _pickles
from ._metadata import StoredChunk

# DCP 2.9-2.11 catches the errors of read_metadata (it then tries the rank's own metadata) and
# raises only AssertionError("metadata is None"); 2.12 puts their messages in it. There the
# reader's reason (no .metadata: an unfinished save; a damaged one) would be lost: it is warned.
_DCP_DROPS_METADATA_ERRORS = "2.9" <= torch.__version__ < "2.12"


class StreamReader(_metadata.CheckpointDirectory, StorageReader):
    """Load a DCP checkpoint that ``StreamWriter`` saved in the directory ``path``, into any
    sharding (DCP reshards: save on 8 ranks, load on 4 or on 1).

    Args:
        path: the checkpoint's directory, or the URL of a folder of any registered storage;
            ``dcp.load(..., checkpoint_id=...)`` replaces it.
        checksum: compare every chunk read whole with its stored CRC-32C (a chunk read in part,
            when resharding cuts it, cannot be checked).
        trust_metadata: unpickle ``.metadata`` and the non-tensor values as they are, which runs
            whatever code the pickles name: only for checkpoints you trust whose planner or state
            stored objects of their own classes. Without it, ``.metadata`` holds only DCP's own
            classes and plain values, and every non-tensor value only plain data (numbers,
            strings, bytes, containers of them, torch sizes and dtypes); anything else is refused
            with CorruptCheckpointError.
        settings: the ``Settings`` of this reader's transfers (a complete value); None: those
            in force when the reader is made (see ``ckptstream.settings``).

    Raises (from ``dcp.load``):
        CorruptCheckpointError: a rank file fails its checksums or is not the file the
            checkpoint's metadata describes, naming the file and the tensor; the metadata or a
            non-tensor value holds what such pickles never hold, naming the file and the class;
            a chunk is stored under a name that is not a file of the checkpoint's directory; the
            metadata is not a regular file.
        ChecksumsMissingError: with ``checksum``, a rank file holds no checksums though the
            metadata records them (its header was rewritten without ckptstream's metadata).
        FileNotFoundError: no ``.metadata`` (a save that did not finish), or a missing rank file.
            From torch 2.9 DCP raises an AssertionError instead when the metadata fails, with
            the reader's message from 2.12; on 2.9-2.11 the reader warns (RuntimeWarning) with it.

    Example:
        >>> dcp.load(state_dict, storage_reader=ckptstream.dcp.StreamReader("ckpt/step-100"))
    """

    def __init__(self, path: str | os.PathLike[str], *, checksum: bool = True, trust_metadata: bool = False,
                 settings: Settings | None = None) -> None:
        super().__init__()
        self.path = _metadata.checkpoint_folder(path)
        self.checksum = checksum
        self.trust_metadata = trust_metadata
        self.cfg = per_call("StreamReader", settings, {})
        self.storage_data: dict[Any, StoredChunk] = {}
        self._metadata_error: Exception | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self._metadata_error = None
        if checkpoint_id:
            self.path = _metadata.checkpoint_folder(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch 2.9+ asks again with rank= for a checkpoint saved without collectives
        rank = kwargs.get("rank")
        try:
            return _metadata.read_metadata(self.path, rank, trusted=self.trust_metadata)
        except Exception as e:
            if rank is None:
                self._metadata_error = e
            elif _DCP_DROPS_METADATA_ERRORS and self._metadata_error is not None:
                # neither metadata loads: the global one's error is the one that explains why
                warnings.warn(f"ckptstream.dcp: {self._metadata_error}", RuntimeWarning, stacklevel=2)
            raise

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        data = metadata.storage_data
        if not isinstance(data, dict) or not all(isinstance(v, StoredChunk) for v in data.values()):
            values = data.values() if isinstance(data, dict) else [data]
            kinds = sorted({type(v).__name__ for v in values})
            raise CorruptCheckpointError(
                f"{self.path}: the checkpoint's chunks are stored as {kinds}, not by ckptstream.dcp.StreamWriter; "
                "load it with the reader of the writer that saved it (torch's FileSystemReader for FileSystemWriter)")
        # read_metadata checked the files' names; so is metadata that came another way
        _metadata.check_storage(metadata, storage_for(self.path).join(self.path, _metadata.METADATA_NAME))
        self.storage_data = data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name in sorted(by_file):
            self._read_file(name, by_file[name], planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Every box this rank needs from one rank file, in one pass in file order."""
        path = storage_for(self.path).join(self.path, name)
        items = sorted(items, key=lambda it: (self.storage_data[it.storage_index].offset, tuple(it.storage_offsets)))
        with CheckpointReader(path, self.cfg) as reader:
            requests: list[tuple[Any, Sequence[int], Sequence[int] | None, torch.Tensor]] = []
            landing: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []  # (item, read into, destination)
            for item in items:
                chunk = self.storage_data[item.storage_index]
                entry = _entry(reader, chunk, path, item.storage_index.fqn, self.checksum)
                if item.type == LoadItemType.BYTE_IO:
                    dst = torch.empty(entry.shape, dtype=torch.uint8)
                    requests.append(((chunk.key,), [0], None, dst))
                    landing.append((item, dst, dst))
                    continue
                dst = planner.resolve_tensor(item).detach()
                into = dst if dst.dtype == entry.dtype else torch.empty(tuple(item.lengths), dtype=entry.dtype,
                                                                        device=dst.device)
                requests.append(((chunk.key,), list(item.storage_offsets), list(item.lengths), into))
                landing.append((item, into, dst))
            reader.read_slices(requests, checksum=self.checksum)
        for item, into, dst in landing:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value(bytes(host_bytes(into)) if into.numel() else b"", path, item))
                continue
            if into is not dst:  # saved in another dtype: converted as DCP's own readers do
                with torch.no_grad():
                    dst.copy_(into)
            planner.commit_tensor(item, dst)

    def _value(self, raw: bytes, path: str, item: ReadItem) -> io.BytesIO:
        """A non-tensor value's torch.save bytes for the planner: as stored when trusted,
        otherwise remade from the plain data they hold."""
        if self.trust_metadata:
            return io.BytesIO(raw)
        return _pickles.plain_value(raw, path, item.storage_index.fqn)


def _entry(reader: CheckpointReader, chunk: StoredChunk, path: str, fqn: str, checksum: bool) -> TensorEntry:
    """The file's entry of a chunk, checked against what the checkpoint's metadata recorded:
    a file that does not match was written by another save; one that lost the checksums its
    save recorded is refused with ``checksum``."""
    try:
        entry = reader.entry((chunk.key,))
    except KeyError:
        entry = None
    if entry is not None and chunk.crc is not None and entry.checksum is None:
        if checksum:
            raise ChecksumsMissingError(
                f"{path}: holds no checksums, though the checkpoint's .metadata records a CRC-32C of tensor {fqn!r} "
                "(its save stored them): a tool rewrote the rank file's header without ckptstream's __metadata__; "
                "restore the checkpoint's directory from a copy, or load with StreamReader(checksum=False) to read it "
                "unchecked")
        chunk = dataclasses.replace(chunk, crc=None)  # the bytes' place is all there is to compare
    if (entry is not None and (entry.offset, entry.end - entry.offset) == (chunk.offset, chunk.length)
            and chunk.crc in (None, entry.checksum)):
        return entry
    have = "no such tensor" if entry is None else f"bytes {entry.offset}..{entry.end}, CRC-32C {_hex(entry.checksum)}"
    raise CorruptCheckpointError(
        f"{path}: tensor {fqn!r} (stored as {chunk.key!r}) should be bytes {chunk.offset}.."
        f"{chunk.offset + chunk.length}, CRC-32C {_hex(chunk.crc)}, as the checkpoint's .metadata records, but the "
        f"file has {have}: it is not the file this checkpoint wrote (replaced by another save?); restore the "
        "checkpoint's directory whole")


def _hex(crc: int | None) -> str:
    return "none" if crc is None else f"{crc:08x}"

