"""What ``ckptstream verify`` and ``inspect`` find in a folder of checkpoint files that is no
CheckpointManager's or DCP's: Lightning's ``.ckpt`` files (StreamCheckpointIO's), safetensors
files, a Hugging Face export (``model.safetensors.index.json`` and its shards). Each file is
checked on its own; an index is checked against its shards: every shard it names is a file of
the folder, every tensor it names is in the shard it names, and no shard holds a tensor that
the index does not name there."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import ckptstream

from ..storage import Entry, storage_for
from ._dirs import Verdict, status_of

FILES = "folder of checkpoint files"
INDEX = "model.safetensors.index.json"  # transformers' name (SAFE_WEIGHTS_INDEX_NAME)
SUFFIXES = (".safetensors", ".ckpt")  # safetensors files (HF shards among them), Lightning's checkpoints
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # save_pretrained's shard names
_INDEX_LIMIT = 64 << 20  # an index names every tensor once: a few MiB for the largest models


def checkpoint_files(entries: Iterable[Entry]) -> list[str]:
    """The names of the folder's checkpoint files, in order (links among them: read where they point)."""
    return [e.name for e in entries if e.kind != "folder" and e.name.endswith(SUFFIXES)]


def has_checkpoints(entries: Iterable[Entry]) -> bool:
    entries = list(entries)
    return bool(checkpoint_files(entries)) or any(e.name == INDEX and e.kind != "folder" for e in entries)


def check_index(folder: str, names: list[str]) -> Verdict:
    """The verdict on a Hugging Face index of ``folder`` (whose checkpoint files are ``names``)
    against its shards. A shard that cannot be opened is left to its own verdict."""
    storage = storage_for(folder)
    path = storage.join(folder, INDEX)
    try:
        weight_map = _weight_map(path, storage.read_small(path, _INDEX_LIMIT))
        # a shard file that the index names no tensor in holds tensors it does not name
        by_shard: dict[str, set[str]] = {name: set() for name in names if _SHARD.fullmatch(name)}
        for key, shard in weight_map.items():
            by_shard.setdefault(shard, set()).add(key)
        for shard, keys in sorted(by_shard.items()):
            if shard not in names:
                raise _corrupt(f"{path} maps {len(keys)} tensor(s) (such as {min(keys)!r}) to {shard!r}, which is not "
                               f"a file of {folder}: the shard is missing; export the model again or restore it")
            try:
                with ckptstream.open(storage.join(folder, shard)) as reader:
                    held = set(reader.keys())
            except (ckptstream.CkptStreamError, OSError, ValueError):
                continue  # its own verdict says why
            if keys - held:
                raise _corrupt(f"{path} maps {sorted(keys - held)[0]!r} to {shard}, which does not hold it (of the "
                               f"{len(keys)} tensors mapped there, {len(keys - held)} are missing): the shard is not "
                               "the one this index was written with")
            if held - keys:
                raise _corrupt(f"{shard} holds {sorted(held - keys)[0]!r}, which {INDEX} does not map to it ("
                               f"{len(held - keys)} such tensors): the shard is not the one this index was written "
                               "with")
    except (ckptstream.CkptStreamError, OSError, ValueError) as e:
        return Verdict(str(e), status_of(e))
    shards = len(by_shard)
    return Verdict(f"{path}: OK (Hugging Face index: {shards} shard{'s' * (shards != 1)}, "
                   f"{len(weight_map)} tensors, each in the shard it names)", 0)


def _weight_map(path: str, raw: bytes) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard's file name), checked."""
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(f"{path} is not JSON ({e}): a damaged index; export the model again") from e
    weight_map: Any = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _corrupt(f"{path} has no \"weight_map\" of tensor names to shard file names: not a Hugging Face index")
    for key, shard in weight_map.items():
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard:
            raise _corrupt(f"{path} maps {key!r} to {shard!r}, which is not a file name in its folder")
    return weight_map


def _corrupt(message: str) -> ckptstream.CorruptCheckpointError:
    return ckptstream.CorruptCheckpointError(message)


def describe_files(folder: str, entries: Iterable[Entry]) -> dict[str, Any]:
    """What ``inspect`` shows of a folder of checkpoint files: its files and their sizes (each
    file's own report is the caller's)."""
    storage = storage_for(folder)
    entries = list(entries)
    names = checkpoint_files(entries)
    return {"path": folder, "kind": FILES, "files": {n: storage.size(storage.join(folder, n)) for n in names},
            "index": INDEX if any(e.name == INDEX for e in entries) else None}
