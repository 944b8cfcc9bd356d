"""What an export reads: the tensors of a source (a checkpoint file, a CheckpointManager
directory or step folder, a DCP checkpoint), each as boxes of bytes in the source's files.

Only headers and metadata are read here, and nothing from the source runs code: checkpoint
files through their validated headers, a DCP checkpoint's ``.metadata`` as ``StreamReader``
reads it (``dcp._metadata``), ``FileSystemWriter`` chunks through ``fsw``.

A manager's step saved by several ranks holds each rank's own state, with no record of how the
ranks' tensors relate. A tensor name found in several rank files must be the same tensor in
each (dtype, shape and stored CRC-32C: the replicas that data-parallel ranks hold) and is read
from the lowest rank; a name found in one rank file only (a pipeline stage's layers) is read
from there. Ranks holding different values under one name (shards saved as plain tensors) are
refused: such states are saved through DCP (``ckptstream.dcp.StreamWriter``, DTensors), whose
metadata records where each shard goes.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
from collections.abc import Sequence
from typing import Any

from .._checkpoint.reader import CheckpointReader, TensorEntry
from .._errors import CorruptCheckpointError, ExportError
from .._manager.directory import DONE, check_step, check_steps, step_of
from .._settings import Settings
from .._storage import storage_for
from .plan import Box, OutTensor, cast_to, check_model_state, strip_prefix

DCP_METADATA = ".metadata"


@dataclasses.dataclass
class Found:
    """A source's tensors to export, in the state's order (tied names left out)."""

    tensors: list[OutTensor]
    tied: dict[str, str]  # a name left out -> the name stored once for it (the same memory in the source)
    what: str  # what the source was taken as, for messages and the CLI
    files: list[str]  # the source's files (an export must not write over them)


def find(src: str, prefix: str | None, dtype: Any, cfg: Settings) -> Found:
    """The tensors under ``prefix`` of the source at ``src``, to be written as ``dtype``."""
    storage = storage_for(src)
    try:
        names = {e.name for e in storage.list_folder(src)}
    except NotADirectoryError:
        found = _from_files([src], prefix, cfg, f"checkpoint file {src}")
    else:
        base = posixpath.basename(src.rstrip("/"))
        if DCP_METADATA in names:
            found = _from_dcp(src, prefix, cfg)
        elif DONE in names or step_of(base) is not None:
            found = _from_step(src, prefix, cfg)
        else:
            found = _from_manager(src, prefix, cfg)
    for t in found.tensors:
        t.out_dtype = cast_to(t.dtype, dtype, f"{src}: {t.key}")
    return found


def _from_manager(directory: str, prefix: str | None, cfg: Settings) -> Found:
    checks = check_steps(directory)
    complete = [c for c in checks if c.complete]
    if not complete:
        why = "; ".join(f"{c.folder}: {c.problem}" for c in checks[-3:])
        raise ExportError(f"{directory}: holds no complete checkpoint to export (a checkpoint file, a "
                          "CheckpointManager directory or step folder, or a DCP checkpoint's folder)"
                          + (f"; its newest steps: {why}" if why else ""))
    return _from_step(complete[-1].folder, prefix, cfg, f" (the newest complete step of {directory})")


def _from_step(folder: str, prefix: str | None, cfg: Settings, how: str = "") -> Found:
    check = check_step(folder)
    if not check.complete:
        raise ExportError(f"{folder}: not a complete step ({check.problem}); export a complete one")
    storage = storage_for(folder)
    files = [storage.join(check.folder, name) for name in check.files]
    ranks = f", {len(files)} ranks" if len(files) > 1 else ""
    return _from_files(files, prefix, cfg, f"step {check.step} in {check.folder}{ranks}{how}")


def _from_files(paths: list[str], prefix: str | None, cfg: Settings, what: str) -> Found:
    merged: dict[str, OutTensor] = {}
    tied: dict[str, str] = {}
    for path in paths:
        with CheckpointReader(path, cfg) as reader:
            tensors, aliases = _file_tensors(reader, prefix, path)
        for t in tensors:
            have = merged.setdefault(t.name, t)
            if have is not t and not _same_replica(have, t):
                raise ExportError(
                    f"{what}: the ranks hold different tensors under {t.key!r} ({_describe(have)} in "
                    f"{have.boxes[0].source}, {_describe(t)} in {path}): shards saved as plain tensors, whose global "
                    "layout no file records. Save sharded states through DCP with ckptstream.dcp.StreamWriter "
                    "(DTensors), or export one rank's file")
        for name, kept in aliases.items():
            tied.setdefault(name, kept)
    return Found(list(merged.values()), {k: v for k, v in tied.items() if k not in merged}, what, paths)


def _same_replica(a: OutTensor, b: OutTensor) -> bool:
    crc_a, crc_b = a.boxes[0].crc, b.boxes[0].crc
    return (a.dtype, a.shape) == (b.dtype, b.shape) and crc_a is not None and crc_a == crc_b


def _describe(t: OutTensor) -> str:
    crc = t.boxes[0].crc
    return f"{t.dtype} {list(t.shape)} CRC-32C {'none' if crc is None else f'{crc:08x}'}"


def _file_tensors(reader: CheckpointReader, prefix: str | None, path: str) -> tuple[list[OutTensor], dict[str, str]]:
    """The tensors of one checkpoint file under ``prefix``; names holding the very tensor of an
    earlier name (tied weights: one record, or equal views of one blob) are left out, mapped to it."""
    entries = reader.entries()
    if len({e.key for e in entries}) != len(entries):
        raise ExportError(f"{path}: several tensors print as the same dotted name (keys holding dots, or an int "
                          "key and its str twin); exported names must differ")
    if prefix is None:
        tree = reader.skeleton()
        items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
        check_model_state({str(k): isinstance(v, TensorEntry) for k, v in items}, path)
    names = strip_prefix([e.key for e in entries], prefix, path)
    tensors: list[OutTensor] = []
    kept: dict[tuple[str, Any], str] = {}
    aliases: dict[str, str] = {}
    for e in entries:
        if e.key not in names:
            continue
        same = kept.setdefault((e.stored_as, e.view), names[e.key])
        if same != names[e.key]:
            aliases[names[e.key]] = same
            continue
        tensors.append(OutTensor(names[e.key], e.key, e.dtype, e.shape, [_entry_box(e, path)], e.dtype))
    return tensors, aliases


def _entry_box(e: TensorEntry, path: str) -> Box:
    zeros = (0,) * len(e.shape)
    what = f"{path}: tensor {e.key!r}"
    if e.view is None:
        return Box(path, e.offset, zeros, e.shape, e.checksum, what)
    if not _row_major(e.shape, e.view.stride):
        raise ExportError(f"{what} was saved as a view (strides {list(e.view.stride)}) of memory it shared with "
                          "other tensors, not row-major: save the model's state with .contiguous() tensors to "
                          "export it")
    return Box(path, e.offset + e.view.offset, zeros, e.shape, None, what)  # its blob's CRC covers more bytes


def _row_major(shape: Sequence[int], stride: Sequence[int]) -> bool:
    return all(n <= 1 or st == math.prod(shape[i + 1 :]) for i, (n, st) in enumerate(zip(shape, stride, strict=True)))


# --- DCP checkpoints ----------------------------------------------------------------------------

def _from_dcp(directory: str, prefix: str | None, cfg: Settings) -> Found:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..dcp import _metadata

    md = _read_metadata(directory)
    tensors_md = {fqn: m for fqn, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if prefix is None:
        check_model_state(_dcp_top_level(md, TensorStorageMetadata), directory)
    names = strip_prefix(list(tensors_md), prefix, directory)
    records = md.storage_data if isinstance(md.storage_data, dict) else {}
    by_chunk = {(i.fqn, _sizes(i.offset, directory, i.fqn)): r for i, r in records.items()
                if getattr(i, "fqn", None) in tensors_md}  # non-tensor values' records have no offsets
    storage = storage_for(directory)
    files = _RankFiles(directory, cfg)
    out = []
    for fqn, name in names.items():
        m = tensors_md[fqn]
        dtype, shape = m.properties.dtype, _sizes(m.size, directory, fqn)
        boxes = []
        for chunk in m.chunks:
            origin, sizes = _sizes(chunk.offsets, directory, fqn), _sizes(chunk.sizes, directory, fqn)
            record = by_chunk.get((fqn, origin))
            what = f"{directory}: the chunk of {fqn!r} at {list(origin)}"
            if isinstance(record, _metadata.StoredChunk):
                boxes.append(files.stream_box(record, dtype, origin, sizes, what))
            elif isinstance(record, _StorageInfo):
                path = storage.join(directory, record.relative_path)
                files.seen.add(path)
                boxes.append(_fsw_box(path, record, dtype, origin, sizes, what))
            else:
                kind = "no record" if record is None else f"a {type(record).__name__}"
                raise ExportError(f"{what} has {kind} in the metadata's storage data: not a checkpoint that "
                                  "ckptstream.dcp.StreamWriter or DCP's FileSystemWriter wrote")
        _check_cover(fqn, shape, boxes, directory)
        out.append(OutTensor(name, fqn, dtype, shape, boxes, dtype))
    return Found(out, {}, f"DCP checkpoint {directory}", sorted(files.seen | {storage.join(directory, DCP_METADATA)}))


def _dcp_top_level(md: Any, tensor_type: type) -> dict[str, bool]:
    """The saved state's top-level keys -> whether each is a tensor, from the key paths that
    DCP's planner records for the names it flattened (a name without one is its own key)."""
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    top: dict[str, bool] = {}
    for fqn, m in md.state_dict_metadata.items():
        path = paths.get(fqn)
        path = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
        key = str(path[0])
        top[key] = top.get(key, True) and len(path) == 1 and isinstance(m, tensor_type)
    return top


def _read_metadata(directory: str) -> Any:
    from ..dcp import _metadata, _pickles

    try:
        return _metadata.read_metadata(directory, None, trusted=False)
    except CorruptCheckpointError as e:
        if not isinstance(e.__cause__, _pickles.Refused):
            raise
        raise ExportError(f"{directory}: its .metadata holds {e.__cause__} (beyond DCP's own classes and plain "
                          "values), so it cannot be read without running code from it. Load the checkpoint with DCP "
                          "in a process that trusts it, save it with ckptstream.save or ckptstream.dcp.StreamWriter, "
                          "and export that") from e


def _sizes(value: Any, directory: str, fqn: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptCheckpointError(f"{directory}: the metadata of {fqn!r} gives {value!r:.80} where sizes or "
                                     "offsets go; it is damaged")
    return tuple(value)


class _RankFiles:
    """The rank files of a StreamWriter checkpoint, each header read once (validated whole)."""

    def __init__(self, directory: str, cfg: Settings) -> None:
        self.directory, self.cfg = directory, cfg
        self.entries: dict[str, dict[str, TensorEntry]] = {}
        self.seen: set[str] = set()

    def stream_box(self, record: Any, dtype: Any, origin: tuple[int, ...], sizes: tuple[int, ...], what: str) -> Box:
        path = storage_for(self.directory).join(self.directory, record.relative_path)
        if path not in self.entries:
            with CheckpointReader(path, self.cfg) as reader:
                self.entries[path] = {e.stored_as: e for e in reader.entries() if e.view is None}
            self.seen.add(path)
        e = self.entries[path].get(record.key)
        nbytes = math.prod(sizes) * dtype.itemsize
        if e is None or (e.offset, e.end - e.offset, e.dtype) != (record.offset, record.length, dtype) \
                or nbytes != record.length or record.crc not in (None, e.checksum):
            raise CorruptCheckpointError(
                f"{what} should be {nbytes} bytes of {dtype} at {record.offset} of {path} (as {record.key!r}), as the "
                "checkpoint's .metadata records, but the file does not hold that: it is not the file this checkpoint "
                "wrote; restore the checkpoint's directory whole")
        return Box(path, e.offset, origin, sizes, e.checksum, f"{what} ({path}: {record.key!r})")


def _fsw_box(path: str, record: Any, dtype: Any, origin: tuple[int, ...], sizes: tuple[int, ...], what: str) -> Box:
    from . import fsw

    if getattr(record, "transform_descriptors", None):
        raise ExportError(f"{what} is stored through DCP's stream extensions {list(record.transform_descriptors)} "
                          "(compression): export reads plain chunks; save without extensions")
    where = f"{what} ({path}, bytes {record.offset}..{record.offset + record.length})"
    with storage_for(path).open(path) as source:
        if record.offset + record.length > source.size():
            raise CorruptCheckpointError(f"{where}: the file is only {source.size()} bytes; it is truncated")
        offset, stored_dtype, shape = fsw.locate(source, record.offset, record.length, where)
    if stored_dtype != dtype or shape != sizes:
        raise CorruptCheckpointError(f"{where}: holds {stored_dtype} {list(shape)}, the metadata says {dtype} "
                                     f"{list(sizes)}; the checkpoint is damaged")
    return Box(path, offset, origin, sizes, None, where)


def _check_cover(fqn: str, shape: tuple[int, ...], boxes: list[Box], directory: str) -> None:
    """Every box inside the tensor, and as many elements as it has (overlaps and holes are
    found as the bytes are placed)."""
    for box in boxes:
        if len(box.origin) != len(shape) or len(box.sizes) != len(shape) or any(
                o + n > s for o, n, s in zip(box.origin, box.sizes, shape, strict=True)):
            raise CorruptCheckpointError(f"{box.what}: a box of {list(box.sizes)} at {list(box.origin)} does not fit "
                                         f"the tensor's shape {list(shape)}; the metadata is damaged")
    covered, numel = sum(b.numel for b in boxes), math.prod(shape)
    if covered != numel:
        raise CorruptCheckpointError(f"{directory}: the chunks of {fqn!r} hold {covered} elements, the tensor "
                                     f"{numel}; the metadata is damaged or misses chunks")
