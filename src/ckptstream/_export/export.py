"""``ckptstream.export_hf``: a checkpoint to a Hugging Face model
folder (``model.safetensors``, or shards and ``model.safetensors.index.json``, as
``save_pretrained`` writes them), streamed through the staging buffers.

The folder: every file (shards, index, ``config.json``) is written to a temp beside its name
and made durable first, its descriptors closed as it is done (nothing in OUT changes while the
tensors stream, so an export that fails leaves an earlier export there as it was). Then only
names change: ``config.json`` is renamed in, the shards, and the weights' last name (the index,
or the single ``model.safetensors``) last; the earlier export's weights that the new names do
not replace go after it. Where a new shard takes the name of a shard of the earlier export, the
earlier index is removed (durably) before that rename, so that no mix of the two exports ever
looks complete. Other files in OUT (a tokenizer, a README) stay as they are.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from typing import Any

import torch

from .. import _gc
from .._engine.control import interrupts_deferred, raise_if_interrupted
from .._errors import ExportError
from .._format import header as _header
from .._progress import progress_bar
from .._settings import Settings, per_call
from .._storage import Sink, Storage, scheme_of, storage_for
from .copy import Copier
from .plan import (
    CONFIG,
    DEFAULT_MAX_SHARD_SIZE,
    HF_METADATA,
    INDEX,
    SAFE_WEIGHTS,
    SHARD,
    OutTensor,
    index_json,
    parse_dtype,
    parse_size,
    shard_names,
    split,
)
from .sources import find

MAX_CONFIG = 16 << 20  # a model's config.json is a few KiB


@dataclasses.dataclass(frozen=True)
class HFExport:
    """What ``export_hf`` wrote: ``files`` in OUT (the weights' last name last), the tensors'
    count and bytes, the names left out as tied to another (name -> the name stored), and what
    the source was taken as."""

    folder: str
    files: list[str]
    tensors: int
    total_size: int
    tied: dict[str, str]
    source: str


def export_hf(src: str | os.PathLike[str], out: str | os.PathLike[str], *, prefix: str | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, dtype: str | torch.dtype | None = None,
              config: str | os.PathLike[str] | None = None, progress: bool = False,
              settings: Settings | None = None) -> HFExport:
    """Export a checkpoint's model tensors to a Hugging Face model folder that
    ``from_pretrained`` loads, streaming them through ckptstream's staging buffers (host memory
    stays at the staging buffers, whatever the model's size).

    Args:
        src: a ckptstream (or safetensors) file; a CheckpointManager directory (its newest
            complete step) or step folder; a DCP checkpoint's folder, written by
            ``ckptstream.dcp.StreamWriter`` or DCP's ``FileSystemWriter`` (DTensors of any
            placement are put back together from their chunks).
        out: the folder to write (created if missing).
        prefix: export only the tensors whose names start with it, without it (``"model."``
            for a state ``{"model": model.state_dict(), "optim": ...}``). None: every tensor of a
            model's flat state ``{name: tensor}`` (a source with any other top-level entry, such
            as a training state's optimizer, is refused); ``""``: every tensor, on purpose.
        max_shard_size: bytes per shard, as an int or "5GB", "500MB", "2GiB"; one shard is
            ``model.safetensors``, more are ``model-00001-of-0000N.safetensors`` and
            ``model.safetensors.index.json`` (cut as ``save_pretrained`` cuts them).
        dtype: "bf16", "fp16" or "fp32": floating-point tensors are cast (as torch's ``.to``
            does); integer, bool and complex tensors are written as stored. None keeps all.
        config: a ``config.json`` to copy into ``out``.
        progress: show a progress bar on stderr.
        settings: the ``Settings`` of this call (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=64 << 20)``); None: those in force (see
            ``ckptstream.settings``).

    Tensors that the source stores as one (tied weights: ``lm_head.weight`` and
    ``wte.weight``) are written once, under the name that comes first in the state, as
    transformers writes them; ``from_pretrained`` ties them again. Every shard holds the
    CRC-32C of each tensor (``ckptstream verify`` checks them), and the source's stored
    checksums are checked as its bytes are read.

    Returns:
        An ``HFExport``: the files written, the tensors' count and bytes, the tied names.

    Raises:
        ExportError: nothing under ``prefix``, more than a model's flat state without one, an
            unknown dtype or size, OUT is a file, holds the source or a link under a name the
            export writes, ranks that disagree, chunks that cannot be read without running code.
        CorruptCheckpointError: the source fails its checksums or does not hold what its
            metadata says (nothing is published).
        FileNotFoundError: ``src`` or ``config`` does not exist.

    Example:
        >>> ckptstream.export_hf("ckpts", "hf-model", prefix="model.", dtype="bf16", config="config.json")
        >>> model = transformers.AutoModelForCausalLM.from_pretrained("hf-model")
    """
    cfg = per_call("export_hf", settings, {})
    target, limit = parse_dtype(dtype), parse_size(max_shard_size)
    src_path, folder = os.fsdecode(src), os.fsdecode(out)
    config_bytes = _read_config(os.fsdecode(config)) if config is not None else None
    with _gc.paused():
        found = find(src_path, prefix, target, cfg)
    shards = split(found.tensors, limit)
    names = shard_names(len(shards))
    storage = storage_for(folder)
    writes = names + ([INDEX] if len(names) > 1 else []) + ([CONFIG] if config_bytes is not None else [])
    _check_folder(storage, folder, found.files, writes)
    storage.make_folders(folder)
    sealed: list[tuple[str, Sink]] = []  # (name, the new file): shards, index, config.json
    total = sum(t.nbytes for t in found.tensors)
    with interrupts_deferred(), progress_bar(progress, total, f"export {posixpath.basename(folder)}") as bar:
        try:
            for shard, name in zip(shards, names, strict=True):
                sealed.append((name, storage.create(storage.join(folder, name))))
                _write_shard(sealed[-1][1], shard, cfg, bar)
                sealed[-1][1].seal()  # its descriptors closed now: an export holds one shard's, however many
            if len(names) > 1:
                _write_small(storage, folder, INDEX, index_json(shards, names), sealed)
            if config_bytes is not None:
                _write_small(storage, folder, CONFIG, config_bytes, sealed)
            raise_if_interrupted()  # until here, OUT is as it was
            _publish(storage, folder, sealed)
        finally:
            for _, sink in sealed:
                sink.abandon()  # those not published (a no-op after publish)
    files = ([CONFIG] if config_bytes is not None else []) + names + ([INDEX] if len(names) > 1 else [])
    return HFExport(folder, files, len(found.tensors), total, dict(found.tied), found.what)


def _write_shard(sink: Sink, shard: list[OutTensor], cfg: Settings, bar: Any) -> None:
    """One output file: its header (checksums as placeholders), the tensors, the checksums."""
    with _gc.paused():
        infos = _header.data_offsets([(t.name, t.out_dtype, t.shape) for t in shard])
        header = _header.encode(infos, HF_METADATA, None, checksums=True)
    by_name = {t.name: t for t in shard}
    sink.write_at(memoryview(header), 0)
    crcs = Copier([by_name[i.name] for i in infos], [i.begin for i in infos], len(header), sink, cfg, bar).run()
    sink.write_at(memoryview(_header.fill(header, crcs)), 0)


def _write_small(storage: Storage, folder: str, name: str, data: bytes, sealed: list[tuple[str, Sink]]) -> None:
    sealed.append((name, storage.create(storage.join(folder, name))))
    sealed[-1][1].write_at(memoryview(data), 0)
    sealed[-1][1].seal()


def _read_config(path: str) -> bytes:
    data = storage_for(path).read_small(path, MAX_CONFIG)
    try:
        parsed = _header.parse_json(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ExportError(f"{path}: not a model's config.json ({e}); give the config that save_pretrained wrote") from e
    if not isinstance(parsed, dict):
        raise ExportError(f"{path}: holds a JSON {type(parsed).__name__}, a config.json an object")
    return data


def _same_file(a: str, b: str) -> bool:
    if scheme_of(a) is None and scheme_of(b) is None:
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def _check_folder(storage: Storage, folder: str, sources: list[str], writes: list[str]) -> None:
    """OUT is a folder (or nothing yet); every name the export ``writes`` is a regular file or
    nothing (a new file is renamed over the name: a symbolic link there would be followed, and
    the file outside OUT replaced); and OUT holds no source file under a name the export writes
    or removes."""
    try:
        entries = storage.list_folder(folder)
    except FileNotFoundError:
        return
    except NotADirectoryError as e:
        raise ExportError(f"{folder}: is a file; OUT is the folder to write the model into") from e
    for entry in entries:
        if entry.name in writes and entry.kind != "file":
            what = "a folder" if entry.kind == "folder" else "not a regular file (a symbolic link, a FIFO or a device)"
            raise ExportError(f"{storage.join(folder, entry.name)}: is {what}, under a name the export writes; the "
                              "export puts a new file of its own there and never writes through a link: remove "
                              "it, or export into another folder")
    ours = [e.name for e in entries if e.name in (SAFE_WEIGHTS, INDEX, CONFIG) or SHARD.fullmatch(e.name)]
    for name in ours:
        for source in sources:
            if _same_file(storage.join(folder, name), source):
                raise ExportError(f"{source}: the source lies in OUT ({folder}) under a name the export replaces; "
                                  "export into another folder")


def _publish(storage: Storage, folder: str, sealed: list[tuple[str, Sink]]) -> None:
    """Name the new files, every one of them durable already: ``config.json``, the shards, the
    index last; then remove what is left of the earlier export. Only names change here."""
    present = {e.name for e in storage.list_folder(folder)}
    for name, sink in sealed:
        if name == CONFIG:
            sink.publish()
    if INDEX in present and any(SHARD.fullmatch(name) and name in present for name, _ in sealed):
        # a new shard renamed over an earlier one of its name would sit under the earlier index: a mix
        # that looks complete; without that index the folder is neither export until the new index is in
        storage.remove(storage.join(folder, INDEX), missing_ok=True)
        storage.sync_folder(folder)
    for name, sink in sealed:
        if name != CONFIG:
            sink.publish()
    _remove_earlier(storage, folder, [name for name, _ in sealed])


def _remove_earlier(storage: Storage, folder: str, names: list[str]) -> None:
    """Remove the earlier export's weights that ``names`` did not replace (its last name
    first: transformers takes a ``model.safetensors`` before an index) and what dead writers
    left of them, durably: an earlier name that a crash brought back could be loaded instead."""
    present = {e.name for e in storage.list_folder(folder)}
    stale = [n for n in sorted(present) if (n in (INDEX, SAFE_WEIGHTS) or SHARD.fullmatch(n)) and n not in names]
    for name in sorted(stale, key=lambda n: n not in (INDEX, SAFE_WEIGHTS)):
        storage.remove(storage.join(folder, name), missing_ok=True)
    for left in storage.unfinished(folder):
        if (left in (SAFE_WEIGHTS, INDEX, CONFIG) or SHARD.fullmatch(left)) and left not in names:
            storage.remove_temps(storage.join(folder, left))
    if stale:
        storage.sync_folder(folder)
