"""What ``ckptstream verify`` and ``inspect`` find in a folder: a CheckpointManager directory
(its step folders), one step folder (its DONE marker and rank files), or a DCP checkpoint's
directory (its ``.metadata``, read without running code from it, and its rank files).

Each check gives a ``Verdict`` per checkpoint: a line to print and an exit status (0 sound; 1
corrupt, or incomplete where a complete checkpoint was asked for; 2 unreadable or not a
checkpoint). A manager directory's incomplete steps are leftovers that the manager ignores:
they are reported, and count against the exit status only when asked for with ``--step``.
The DCP package (and torch.distributed with it) is imported only for a DCP directory.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

from . import _layout, _load
from ._errors import CkptStreamError, CorruptCheckpointError

MANAGER, STEP, DCP = "CheckpointManager directory", "CheckpointManager step folder", "DCP checkpoint"
MAX_DONE = 1 << 20  # a DONE marker names one file per rank: a larger one is not a marker
_RANK_METADATA = re.compile(r"__(\d+)\.metadata")
_DCP_RANK_FILE = re.compile(r"rank-\d{5}\.safetensors")
_MANAGER_FILE = re.compile(r"state\.safetensors|rank-\d+-of-\d+\.safetensors|FAILED-rank-\d+")


@dataclasses.dataclass
class Verdict:
    """One checkpoint's outcome: ``line`` (starting with its path) and the exit status."""

    line: str
    status: int


def is_dcp_metadata_name(name: str) -> bool:
    return name == ".metadata" or _RANK_METADATA.fullmatch(name) is not None


def folder_kind(path: str) -> str | None:
    """MANAGER, STEP or DCP for a folder that holds one, else None."""
    names = set(os.listdir(path))
    if any(is_dcp_metadata_name(n) or _DCP_RANK_FILE.fullmatch(n) for n in names):
        return DCP
    if _layout.DONE in names or any(_MANAGER_FILE.fullmatch(n) for n in names):
        return STEP
    return MANAGER if _layout.step_dirs(path) else None


def plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside a folder (no folder part, not "." or "..")."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and os.path.basename(name) == name and "/" not in name)


def _regular_file(path: str) -> str | None:
    """Why ``path`` cannot be read as a small regular file (None when it can)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return None


# --- manager steps ------------------------------------------------------------------------------


def step_done(folder: str) -> tuple[dict[str, Any] | None, str]:
    """A step folder's DONE marker when the step is complete, else None and why not."""
    done_path = os.path.join(folder, _layout.DONE)
    why = _regular_file(done_path)
    if why == "missing":
        failed = sorted(n for n in os.listdir(folder) if n.startswith("FAILED-rank-"))
        if failed:
            return None, f"no DONE marker, and {', '.join(failed)}: a rank's save of this step failed"
        return None, "no DONE marker: a save that did not finish (or is still running)"
    if why is not None:
        return None, f"DONE is {why}"
    size = os.path.getsize(done_path)
    if size > MAX_DONE:
        return None, f"DONE is {size} bytes, more than a marker ever holds"
    try:
        done = _layout.read_done(folder)
    except RecursionError:  # a marker nested too deep to parse
        done = None
    if done is None:
        return None, _why_not_done(folder, done_path)
    files = done["files"]
    outside = [n for n in files if not plain_name(n)]
    if outside:
        return None, f"DONE names a file outside the step folder ({outside[0]!r:.80}): not a marker ckptstream wrote"
    if len(files) != done["world_size"]:
        return None, f"DONE lists {len(files)} files for {done['world_size']} ranks"
    return done, ""


def _why_not_done(folder: str, done_path: str) -> str:
    """Why DONE (a small regular file) does not make its step complete."""
    try:
        with open(done_path, "rb") as f:
            done = json.loads(f.read(MAX_DONE + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        return f"DONE cannot be read as JSON ({type(e).__name__}: {e!s:.100})"
    if not isinstance(done, dict) or done.get("format") != _layout.FORMAT:
        return f"DONE is not a CheckpointManager marker (format {_get(done, 'format')!r:.60})"
    files = done.get("files")
    if not isinstance(files, dict) or not isinstance(done.get("world_size"), int):
        return "DONE does not list the step's files and world size"
    for name, size in files.items():
        if not plain_name(name):
            return f"DONE names a file outside the step folder ({name!r:.80})"
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name}, which DONE lists, is missing"
        if os.path.getsize(path) != size:
            return f"{name} is {os.path.getsize(path)} bytes; DONE records {size!r:.40}"
    return "DONE does not describe a complete step"


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def check_step(folder: str, *, leftover_ok: bool = False) -> Verdict:
    """Verify a step folder: complete (DONE), and every file DONE lists sound (checksums)."""
    done, reason = step_done(folder)
    if done is None:
        if leftover_ok:
            return Verdict(f"{folder}: incomplete, ignored by the manager: {reason}", 0)
        return Verdict(f"{folder}: INCOMPLETE: {reason}", 1)
    tensors, unchecked = 0, []
    for name in sorted(done["files"]):
        try:
            with _load.open(os.path.join(folder, name)) as reader:
                reader.verify()
                tensors += len(reader)
                if not reader.checksummed:
                    unchecked.append(name)
        except (CkptStreamError, OSError, ValueError) as e:
            return Verdict(f"{folder}: step {done['step']}: {e}", 1 if isinstance(e, CkptStreamError) else 2)
    files = len(done["files"])
    how = "checksums verified" if not unchecked else f"structure only for {', '.join(unchecked)}: no checksums"
    return Verdict(f"{folder}: OK (step {done['step']}: {files} file{'s' * (files != 1)}, {tensors} tensors, {how})", 0)


def step_folder(directory: str, step: int) -> str | Verdict:
    """The folder of ``step`` in a manager directory, or the verdict that it has none."""
    folders = _layout.step_dirs(directory)
    if step not in folders:
        listed = ", ".join(map(str, sorted(folders)[-10:]))
        return Verdict(f"{directory}: no step {step} (its step folders: {listed})", 2)
    return folders[step]


def check_manager(directory: str, step: int | None = None) -> list[Verdict]:
    """Every step folder of a manager directory (or only ``step``)."""
    if step is not None:
        folder = step_folder(directory, step)
        return [folder if isinstance(folder, Verdict) else check_step(folder)]
    folders = _layout.step_dirs(directory)
    verdicts = [check_step(folders[s], leftover_ok=True) for s in sorted(folders)]
    if not any(step_done(folder)[0] is not None for folder in folders.values()):
        verdicts.append(Verdict(f"{directory}: INCOMPLETE: no complete step among its {len(folders)} step folders", 1))
    return verdicts


def describe_manager(directory: str) -> dict[str, Any]:
    """What ``inspect`` shows of a manager directory: its steps, complete or not, and their files."""
    steps = []
    for step, folder in sorted(_layout.step_dirs(directory).items()):
        done, reason = step_done(folder)
        entry: dict[str, Any] = {"step": step, "folder": folder, "complete": done is not None}
        if done is None:
            entry["reason"] = reason
        else:
            entry["files"] = dict(sorted(done["files"].items()))
        steps.append(entry)
    complete = [s["step"] for s in steps if s["complete"]]
    return {"path": directory, "kind": MANAGER, "steps": steps, "latest": complete[-1] if complete else None}


def describe_step(folder: str) -> dict[str, Any]:
    """What ``inspect`` shows of a step folder: DONE, and each rank file's own report."""
    done, reason = step_done(folder)
    out: dict[str, Any] = {"path": folder, "kind": STEP, "complete": done is not None}
    if done is None:
        out["reason"] = reason
        return out
    out.update(step=done["step"], world_size=done["world_size"], files=dict(sorted(done["files"].items())))
    return out


# --- DCP ----------------------------------------------------------------------------------------


def _metadata_ranks(directory: str) -> Sequence[int | None]:
    """Which metadata the checkpoint has: the global ``.metadata`` ([None]), else the ranks'
    own ``__N.metadata`` of ranks that saved without collectives."""
    names = os.listdir(directory)
    if ".metadata" in names:
        return [None]
    return [*sorted(int(m.group(1)) for n in names if (m := _RANK_METADATA.fullmatch(n)))]


def read_dcp(directory: str) -> list[Any]:
    """The checkpoint's metadata (one, or one per rank), read without running code from it;
    raises CorruptCheckpointError, or FileNotFoundError where there is none."""
    from .dcp import _metadata

    ranks = _metadata_ranks(directory)
    if not ranks:
        raise FileNotFoundError(errno.ENOENT, "no .metadata: not a complete DCP checkpoint (a save that did not "
                                              "finish leaves none); use an earlier checkpoint", directory)
    out = []
    for rank in ranks:
        path = os.path.join(directory, _metadata.metadata_name(rank))
        why = _regular_file(path)
        if why is not None:
            raise _corrupt(f"{path} is {why}")
        out.append(_metadata.read_metadata(directory, rank, trusted=False))
    return out


def _corrupt(message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(message)


def dcp_chunks(directory: str, metadata: Any) -> dict[str, list[Any]]:
    """The storage records of every chunk the metadata names, by file; raises for a chunk
    without a record and for a record naming a file outside the directory."""
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
        name = getattr(record, "relative_path", None)
        if not plain_name(name):
            raise _corrupt(f"{directory}: a chunk is stored in {name!r:.80}, not a file of the checkpoint's folder")
        by_file.setdefault(name, []).append(record)  # type: ignore[arg-type]
    return dict(sorted(by_file.items()))


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
    except (CkptStreamError, OSError, ValueError) as e:
        return Verdict(f"{directory}: {e}", 1 if isinstance(e, CkptStreamError) else 2)
    how = "checksums verified" if not foreign else (
        f"{len(foreign)} file(s) of another writer present with the bytes the metadata records; they hold no checksums")
    return Verdict(f"{directory}: OK ({DCP}: {files} rank file{'s' * (files != 1)}, {chunks} chunks, {how})", 0)


def _check_dcp_file(directory: str, name: str, records: list[Any]) -> bool:
    """Check one data file against its records; True where another writer made it (no checksums)."""
    from .dcp import StoredChunk

    path = os.path.join(directory, name)
    why = _regular_file(path)
    if why is not None:
        raise _corrupt(f"{path}, which the metadata names, is {why}")
    if not all(isinstance(r, StoredChunk) for r in records):
        size = os.path.getsize(path)
        short = [r for r in records if getattr(r, "offset", 0) + getattr(r, "length", 0) > size]
        if short:
            raise _corrupt(f"{path} is {size} bytes, but the metadata records a chunk at bytes {short[0].offset}.."
                           f"{short[0].offset + short[0].length}: the file is truncated")
        return True
    with _load.open(path) as reader:
        for record in records:
            entry = reader.entry((record.key,)) if (record.key,) in reader else None
            if entry is None or (entry.offset, entry.end - entry.offset) != (record.offset, record.length) or (
                    record.crc is not None and record.crc != entry.checksum):
                raise _corrupt(f"{path}: chunk {record.key!r} is not where the checkpoint's .metadata records it "
                               f"(bytes {record.offset}..{record.offset + record.length}): the file is not the one "
                               "this checkpoint wrote")
        reader.verify()
    return False


def describe_dcp(directory: str) -> dict[str, Any]:
    """What ``inspect`` shows of a DCP checkpoint: its tensors (global shape, dtype, chunks), its
    other values, and its files."""
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
            path = os.path.join(directory, name)
            files[name] = {"chunks": len(records), "bytes": os.path.getsize(path) if os.path.isfile(path) else None}
    return {"path": directory, "kind": DCP, "tensors": tensors, "values": values, "files": files}
