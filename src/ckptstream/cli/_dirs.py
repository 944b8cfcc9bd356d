"""What ``ckptstream verify`` and ``inspect`` find in a folder: a CheckpointManager directory
(its step folders), one step folder (its DONE marker and rank files), or a DCP checkpoint's
directory (its ``.metadata`` and its rank files).

The checks are the library's own, so the command says what the library would do: whether a step
is complete, and why not, is ``ckptstream.check_step`` (DONE read bounded and without blocking,
only plain names of the folder); a DCP checkpoint's metadata is read as ``StreamReader`` reads
it (a regular file of bounded size, unpickled without running code, every chunk stored under a
plain name of the folder). What the command adds: the checksums of every file, and that every
chunk the metadata names is recorded in a file that holds it.

Each check gives a ``Verdict`` per checkpoint: a line to print and an exit status (0 sound; 1
corrupt, or incomplete where a complete checkpoint was asked for; 2 unreadable or not a
checkpoint). A manager directory's incomplete steps are leftovers that the manager ignores:
they are reported, and count against the exit status only when asked for with ``--step``.
The DCP package (and torch.distributed with it) is imported only for a DCP directory.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import ckptstream

from ..storage import Entry, storage_for

MANAGER, STEP, DCP = "CheckpointManager directory", "CheckpointManager step folder", "DCP checkpoint"
METADATA = ".metadata"  # DCP's name (ckptstream.dcp.METADATA_NAME, which imports torch.distributed)
_RANK_METADATA = re.compile(r"__(\d+)\.metadata")
_DCP_RANK_FILE = re.compile(r"rank-\d{5}\.safetensors")


@dataclasses.dataclass
class Verdict:
    """One checkpoint's outcome: ``line`` (starting with its path) and the exit status."""

    line: str
    status: int


def status_of(error: Exception) -> int:
    """The exit status of an error met checking a checkpoint: 2 where it could not be read (an
    OSError, a request to an object store that failed among them) or was bad input (a
    ValueError), 1 where ckptstream found it corrupt."""
    if isinstance(error, OSError):
        return 2
    return 1 if isinstance(error, ckptstream.CkptStreamError) else 2


def is_dcp_metadata_name(name: str) -> bool:
    return name == METADATA or _RANK_METADATA.fullmatch(name) is not None


def folder_kind(path: str, entries: Iterable[Entry]) -> str | None:
    """MANAGER, STEP or DCP for a folder (with ``entries``) that holds one, else None."""
    if any(is_dcp_metadata_name(e.name) or _DCP_RANK_FILE.fullmatch(e.name) for e in entries):
        return DCP
    if ckptstream.check_step(path).own:
        return STEP
    return MANAGER if ckptstream.check_steps(path) else None


# --- manager steps ------------------------------------------------------------------------------


def check_step(check: ckptstream.StepCheck, *, leftover_ok: bool = False) -> Verdict:
    """Verify a step folder: complete, and every rank file sound (checksums)."""
    if not check.complete:
        if leftover_ok:
            return Verdict(f"{check.folder}: incomplete, ignored by the manager: {check.problem}", 0)
        return Verdict(f"{check.folder}: INCOMPLETE: {check.problem}", 1)
    storage = storage_for(check.folder)
    step = f"step {check.step}: " if check.step is not None else ""
    tensors, unchecked = 0, []
    for name in check.files:
        try:
            with ckptstream.open(storage.join(check.folder, name)) as reader:
                reader.verify()
                tensors += len(reader)
                if not reader.checksummed:
                    unchecked.append(name)
        except (ckptstream.CkptStreamError, OSError, ValueError) as e:
            return Verdict(f"{check.folder}: {step}{e}", status_of(e))
    files = len(check.files)
    how = "checksums verified" if not unchecked else f"structure only for {', '.join(unchecked)}: no checksums"
    return Verdict(f"{check.folder}: OK ({step}{files} file{'s' * (files != 1)}, {tensors} tensors, {how})", 0)


def step_check(directory: str, step: int) -> ckptstream.StepCheck | Verdict:
    """The check of ``step`` of a manager directory, or the verdict that it has none."""
    checks = ckptstream.check_steps(directory)
    found = [c for c in checks if c.step == step]
    if not found:
        listed = ", ".join(str(c.step) for c in checks[-10:])
        return Verdict(f"{directory}: no step {step} (its step folders: {listed})", 2)
    return found[0]


def check_manager(directory: str, step: int | None = None) -> list[Verdict]:
    """Every step folder of a manager directory (or only ``step``)."""
    if step is not None:
        found = step_check(directory, step)
        return [found if isinstance(found, Verdict) else check_step(found)]
    checks = ckptstream.check_steps(directory)
    verdicts = [check_step(c, leftover_ok=True) for c in checks]
    if not any(c.complete for c in checks):
        verdicts.append(Verdict(f"{directory}: INCOMPLETE: no complete step among its {len(checks)} step folders", 1))
    return verdicts


def describe_manager(directory: str) -> dict[str, Any]:
    """What ``inspect`` shows of a manager directory: its steps, complete or not, and their files."""
    steps = []
    for check in ckptstream.check_steps(directory):
        entry: dict[str, Any] = {"step": check.step, "folder": check.folder, "complete": check.complete}
        if check.complete:
            entry["files"] = dict(check.files)
        else:
            entry["reason"] = check.problem
        steps.append(entry)
    complete = [s["step"] for s in steps if s["complete"]]
    return {"path": directory, "kind": MANAGER, "steps": steps, "latest": complete[-1] if complete else None}


def describe_step(check: ckptstream.StepCheck) -> dict[str, Any]:
    """What ``inspect`` shows of a step folder: complete or why not, and its rank files."""
    out: dict[str, Any] = {"path": check.folder, "kind": STEP, "complete": check.complete}
    if not check.complete:
        out["reason"] = check.problem
        return out
    out.update(step=check.step, world_size=check.world_size, files=dict(check.files))
    return out


# --- DCP ----------------------------------------------------------------------------------------


def read_dcp(directory: str) -> list[Any]:
    """The checkpoint's metadata, read as ``StreamReader`` reads it: the global ``.metadata``, or
    where there is none, the ranks' own ``__N.metadata`` of ranks that saved without collectives.
    Raises CorruptCheckpointError, or FileNotFoundError where there is none."""
    from ..dcp import StreamReader

    names = [e.name for e in storage_for(directory).list_folder(directory)]
    ranks = [] if METADATA in names else sorted(int(m.group(1)) for n in names if (m := _RANK_METADATA.fullmatch(n)))
    reader = StreamReader(directory)
    if not ranks:
        return [reader.read_metadata()]  # says why where it cannot
    return [reader.read_metadata(rank=rank) for rank in ranks]


def dcp_chunks(directory: str, metadata: Any) -> dict[str, list[Any]]:
    """The storage records of every chunk the metadata names, by file; raises for a chunk
    without a record, and for a record that names no file."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _corrupt(f"{directory}: the metadata's storage records are a {type(storage).__name__}, not a mapping")
    for fqn, meta in metadata.state_dict_metadata.items():
        for index in _chunk_indices(fqn, meta):
            if index not in storage:
                raise _corrupt(f"{directory}: the metadata names a chunk of {fqn!r} at offsets "
                               f"{list(index.offset or [])} but records no file for it")
    by_file: dict[str, list[Any]] = {}
    for record in storage.values():
        name = getattr(record, "relative_path", None)  # a plain name: checked when it was read
        if not isinstance(name, str):
            raise _corrupt(f"{directory}: a chunk's storage record is a {type(record).__name__}, which names no file")
        by_file.setdefault(name, []).append(record)
    return dict(sorted(by_file.items()))


def _corrupt(message: str) -> ckptstream.CorruptCheckpointError:
    return ckptstream.CorruptCheckpointError(message)


def _chunk_indices(fqn: str, meta: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    chunks = getattr(meta, "chunks", None)
    if chunks is None:  # a non-tensor value: one record under its name
        return [MetadataIndex(fqn)]
    return [MetadataIndex(fqn, chunk.offsets) for chunk in chunks]


def check_dcp(directory: str) -> Verdict:
    """Verify a DCP checkpoint: its metadata, every chunk it names recorded in a file of the
    folder, each of ckptstream's rank files sound and holding its chunks where the metadata
    says; files of other writers present with the bytes the metadata records."""
    try:
        metadatas = read_dcp(directory)
        chunks = files = 0
        foreign: set[str] = set()
        for metadata in metadatas:
            for name, records in dcp_chunks(directory, metadata).items():
                files += 1
                chunks += len(records)
                if _check_dcp_file(directory, name, records):
                    foreign.add(name)
    except FileNotFoundError as e:
        return Verdict(f"{directory}: INCOMPLETE: {e.strerror}", 1)
    except (ckptstream.CkptStreamError, OSError, ValueError) as e:
        return Verdict(f"{directory}: {e}", status_of(e))
    how = "checksums verified" if not foreign else (
        f"{len(foreign)} file(s) of another writer present with the bytes the metadata records; they hold no checksums")
    return Verdict(f"{directory}: OK ({DCP}: {files} rank file{'s' * (files != 1)}, {chunks} chunks, {how})", 0)


def _check_dcp_file(directory: str, name: str, records: list[Any]) -> bool:
    """Check one data file against its records; True where another writer made it (no checksums)."""
    from ..dcp import StoredChunk

    storage = storage_for(directory)
    path = storage.join(directory, name)
    kind = storage.kind(path)
    if kind != "file":
        raise _corrupt(f"{path}, which the metadata names, is {'missing' if kind is None else 'not a regular file'}")
    if not all(isinstance(r, StoredChunk) for r in records):
        size = storage.size(path)
        short = [r for r in records if getattr(r, "offset", 0) + getattr(r, "length", 0) > size]
        if short:
            raise _corrupt(f"{path} is {size} bytes, but the metadata records a chunk at bytes {short[0].offset}.."
                           f"{short[0].offset + short[0].length}: the file is truncated")
        return True
    with ckptstream.open(path) as reader:
        for record in records:
            entry = reader.entry((record.key,)) if (record.key,) in reader else None
            if entry is None or (entry.offset, entry.end - entry.offset) != (record.offset, record.length):
                raise _corrupt(f"{path}: chunk {record.key!r} is not where the checkpoint's .metadata records it "
                               f"(bytes {record.offset}..{record.offset + record.length}): the file is not the one "
                               "this checkpoint wrote")
            # a file of another save with the same layout differs only here (its own checksums hold)
            if record.crc is not None and record.crc != entry.checksum:
                stored = "none" if entry.checksum is None else f"{entry.checksum:08x}"
                raise _corrupt(f"{path}: chunk {record.key!r} has CRC-32C {stored} in the file, but the checkpoint's "
                               f".metadata records {record.crc:08x}: the file is from another save; restore this "
                               "save's copy of it")
        reader.verify()
    return False


def describe_dcp(directory: str) -> dict[str, Any]:
    """What ``inspect`` shows of a DCP checkpoint: its tensors (global shape, dtype, chunks), its
    other values, and its files."""
    storage = storage_for(directory)
    tensors, values, files = [], [], {}
    for metadata in read_dcp(directory):
        for fqn, meta in metadata.state_dict_metadata.items():
            chunks = getattr(meta, "chunks", None)
            if chunks is None:
                values.append(fqn)
            else:
                tensors.append({"key": fqn, "dtype": str(meta.properties.dtype).removeprefix("torch."),
                                "shape": list(meta.size), "chunks": len(chunks)})
        for name, records in dcp_chunks(directory, metadata).items():
            path = storage.join(directory, name)
            size = storage.size(path) if storage.kind(path) == "file" else None
            files[name] = {"chunks": len(records), "bytes": size}
    return {"path": directory, "kind": DCP, "tensors": tensors, "values": values, "files": files}
