"""load_into: fill the tensors of a live state in place from a checkpoint.

Everything is matched and checked (keys, shapes, dtypes) before a single byte is written. Each
tensor of the file streams straight into its target; only storage shared in the file by
*different* views (rare: a tensor saved with an overlapping view of itself) goes through a
temporary of that storage's size on the target's device.
"""

from __future__ import annotations

import collections
import itertools
import os
import warnings
from typing import Any

import torch

from . import _gc
from ._engine import check_tensor, copyable
from ._errors import StateMismatchError, StateMismatchWarning
from ._flatten import walk
from ._header import empty_tensor
from ._load import checksum_argument, open
from ._reader import CheckpointReader, TensorEntry, target_device
from ._settings import INHERIT
from ._structure import KeyPath, key_str, make_view


def _memory(t: torch.Tensor) -> tuple[object, ...]:
    return t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _memory(a) == _memory(b)


def _tied(targets: dict[KeyPath, torch.Tensor], entries: dict[KeyPath, TensorEntry]) -> set[KeyPath]:
    """Targets the file lacks that are the very memory of a target it has: tied weights saved
    once (transformers' ``lm_head.weight`` is ``transformer.wte.weight``); filling one fills both."""
    in_file = {_memory(t) for p, t in targets.items() if p in entries and t.numel()}
    return {p for p, t in targets.items() if p not in entries and t.numel() and _memory(t) in in_file}


def _match(reader: CheckpointReader, targets: dict[KeyPath, torch.Tensor], strict: bool) -> None:
    """Raise one StateMismatchError listing every problem; warn about skipped keys if not strict."""
    entries = {e.path: e for e in reader.entries()}
    tied = _tied(targets, entries)
    missing = [key_str(p) for p in targets if p not in entries and p not in tied]
    unexpected = [key_str(p) for p in entries if p not in targets]
    wrong = [f"{key_str(p)}: the file has {entries[p].dtype} {list(entries[p].shape)}, the state {t.dtype} "
             f"{list(t.shape)}" for p, t in targets.items()
             if p in entries and (t.dtype, tuple(t.shape)) != (entries[p].dtype, entries[p].shape)]
    problems = [f"shape/dtype mismatch: {w}" for w in wrong]
    if strict:
        problems += [f"missing from the file: {m}" for m in missing]
        problems += [f"in the file but not in the state: {u}" for u in unexpected]
    if problems:
        hint = "" if not strict or wrong else " (strict=False loads the keys both sides have)"
        raise StateMismatchError(f"{reader.path} does not match the state{hint}:\n  " + "\n  ".join(problems))
    if missing or unexpected:
        warnings.warn(
            StateMismatchWarning(f"load_into({reader.path!r}, strict=False) skipped {len(missing)} missing key(s) "
                                 f"{missing[:5]} and {len(unexpected)} unexpected key(s) {unexpected[:5]}",
                                 missing, unexpected),
            stacklevel=3,
        )


def _check_destinations(reader: CheckpointReader, targets: dict[KeyPath, torch.Tensor]) -> None:
    """Raise one StateMismatchError, before a byte is written, for every target the file's bytes
    cannot land in: one that is not a dense CPU or CUDA tensor, whose elements share memory
    (an expanded view), or whose memory overlaps another target's (unless both are the same
    tensor, or views the file stores over the same bytes)."""
    entries = {e.path: e for e in reader.entries()}
    filled = {p: t for p, t in targets.items() if p in entries}
    problems = []
    for p, t in filled.items():
        try:
            check_tensor(t, key_str(p), writable=True)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
            continue
        if _self_overlapping(t):
            problems.append(f"{key_str(p)}: its elements share memory (strides {t.stride()}), so it cannot hold "
                            "distinct values")
    problems += _overlaps(filled, entries)
    if problems:
        raise StateMismatchError(f"{reader.path}: the state has tensors the checkpoint cannot be loaded into, "
                                 "nothing was written:\n  " + "\n  ".join(problems))


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: by its strides, each dimension (smallest
    stride first) must step past everything the smaller ones span."""
    span = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def _overlaps(filled: dict[KeyPath, torch.Tensor], entries: dict[KeyPath, TensorEntry]) -> list[str]:
    """Pairs of targets whose bytes overlap (a sweep over each storage's byte ranges)."""
    by_storage: dict[tuple[object, int], list[tuple[int, int, KeyPath]]] = {}
    for p, t in filled.items():
        if t.numel() and t.layout == torch.strided:
            start = int(t.storage_offset()) * t.element_size()
            last = int(sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))) * t.element_size()
            key = (t.device, t.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append((start, start + last + t.element_size(), p))
    problems = []
    for ranges in by_storage.values():
        ranges.sort(key=lambda r: r[0])
        for (_, end, a), (start, _, b) in itertools.pairwise(ranges):
            if start >= end or _same_memory(filled[a], filled[b]):
                continue
            ea, eb = entries[a], entries[b]
            if ea.view is not None and eb.view is not None and ea.stored_as == eb.stored_as:
                continue  # views the file stores over the same bytes: written consistently
            problems.append(f"{key_str(a)} and {key_str(b)} overlap in memory, but the file holds them apart: "
                            "loading one would overwrite the other")
    return problems


def _destinations(entries: list[TensorEntry], targets: dict[KeyPath, torch.Tensor], blobs: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Where each stored tensor streams to, and the copies to make once it is read and verified:
    the same tensor saved twice, and views of shared storage (read into a temporary, or into the
    ``blobs`` created for them)."""
    dests: dict[str, torch.Tensor] = dict(blobs)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, loaded source)
    for e in entries:
        if e.path in targets and e.view is None:
            target = targets[e.path]
            if e.stored_as in dests and not _same_memory(dests[e.stored_as], target):
                copies.append((target, dests[e.stored_as]))
            dests.setdefault(e.stored_as, target)
    for e in entries:
        if e.path in targets and e.view is not None:
            if e.stored_as not in dests:
                dests[e.stored_as] = torch.empty(e.end - e.offset, dtype=torch.uint8, device=targets[e.path].device)
            source = make_view(dests[e.stored_as], e.view)
            if not _same_memory(source, targets[e.path]):
                copies.append((targets[e.path], source))
    return dests, copies


def _empty_containers(node: Any, path: KeyPath = (), found: set[KeyPath] | None = None) -> set[KeyPath]:
    found = set() if found is None else found
    if type(node) in (dict, collections.OrderedDict):
        if not node:
            found.add(path)
        for k, v in node.items():
            _empty_containers(v, (*path, k), found)
    elif type(node) in (list, tuple):
        if not node:
            found.add(path)
        for i, v in enumerate(node):
            _empty_containers(v, (*path, i), found)
    return found


def _created(reader: CheckpointReader, state: Any, targets: dict[KeyPath, torch.Tensor], device: Any
             ) -> tuple[dict[KeyPath, torch.Tensor], dict[str, torch.Tensor]]:
    """New tensors for the file's tensors that ``state`` lacks below an empty container of it,
    and the blobs of shared bytes that those stored as views are views of (each of its stored
    size: a view's shape may describe more)."""
    empty = _empty_containers(state) if device is not None else set()
    wanted = [e for e in reader.entries()
              if empty and e.path not in targets and any(e.path[:i] in empty for i in range(len(e.path)))]
    if not wanted:
        return {}, {}
    if device == "auto":
        gpus = {t.device for t in targets.values() if t.device.type != "cpu"}
        if len(gpus) > 1:
            raise StateMismatchError(f"load_into({reader.path!r}): the state's tensors are on "
                                     f"{sorted(map(str, gpus))}: pass device= to say where to create the "
                                     "file's tensors that it lacks")
        where = gpus.pop() if gpus else torch.device("cpu")
    else:
        where = target_device(device)
    created: dict[KeyPath, torch.Tensor] = {}
    blobs: dict[str, torch.Tensor] = {}
    aliases: dict[tuple[str, torch.device], torch.Tensor] = {}  # one tensor stored once: one tensor created
    for e in wanted:
        dev = torch.device("cpu") if not e.shape else where
        if e.view is not None:
            if e.stored_as not in blobs:
                blobs[e.stored_as] = torch.empty(e.end - e.offset, dtype=torch.uint8, device=where)
            created[e.path] = make_view(blobs[e.stored_as], e.view)
        else:
            key = (e.stored_as, dev)
            if key not in aliases:
                aliases[key] = empty_tensor(e.shape, e.dtype, dev)
            created[e.path] = aliases[key]
    return created, blobs


def load_into(state: Any, path: str | os.PathLike[str], *, strict: bool = True, device: Any = "auto",
              checksum: bool = True, progress: bool = False, verify: bool | None = None, buffer_size: Any = INHERIT,
              num_buffers: Any = INHERIT, io_threads: Any = INHERIT, direct_io: Any = INHERIT) -> Any:
    """Fill the tensors of ``state`` in place (same storage, on their own devices) from a checkpoint.

    Args:
        state: a state of the same structure as the saved one (e.g. ``{"model":
            model.state_dict(), ...}``); its tensors are the destinations.
        path: the checkpoint file.
        strict: with True, any missing key, unexpected key, shape or dtype mismatch raises
            StateMismatchError before anything is written. With False, keys on one side only
            are skipped and listed in a ``StateMismatchWarning`` (with ``.missing`` and
            ``.unexpected``); shape and dtype mismatches still raise.
        device: where to create the file's tensors that ``state`` lacks below one of its
            *empty* containers: a freshly built optimizer's ``state_dict()`` has ``"state":
            {}``, so its moments are created (and read) there, ready for
            ``optimizer.load_state_dict``; put ``{}`` (or ``[]``) where you want whatever the
            file holds. "auto": the GPU of the state's tensors (the CPU if they are all there;
            several GPUs: pass a device). 0-d tensors (optimizer step counters) are created on
            the CPU, where ``torch.optim`` keeps them (fused and capturable optimizers'
            ``load_state_dict`` moves them). None: create nothing (such tensors are then
            unexpected keys).
        checksum: compare every tensor with its stored CRC-32C after reading it (``verify`` in
            0.1.0; a mismatch raises CorruptCheckpointError, see docs/reliability.md for what
            the targets then hold).
        progress: show a progress bar on stderr.
        buffer_size, num_buffers, io_threads, direct_io: override ``ckptstream.settings`` for
            this call.

    Returns:
        The file's structure with its non-tensor leaves (step, param_groups, ...) and the
        given tensors at their places, and the tensors created (``device``); other file tensors
        the state lacks (strict=False) are None.

    Example:
        >>> loaded = ckptstream.load_into({"model": model.state_dict(), "step": 0}, "ckpt.safetensors")
        >>> step = loaded["step"]
        >>> loaded = ckptstream.load_into({"model": model.state_dict(), "optim": fresh_opt.state_dict()}, path)
        >>> fresh_opt.load_state_dict(loaded["optim"])   # the moments were created on the model's GPU
    """
    checksum = checksum_argument(checksum, verify, "load_into")
    with _gc.paused():
        targets = {p: v for p, v in walk(state) if isinstance(v, torch.Tensor)}
    with open(path, buffer_size=buffer_size, num_buffers=num_buffers, io_threads=io_threads,
              direct_io=direct_io) as reader:
        with _gc.paused():
            created, blobs = _created(reader, state, targets, device)
            targets.update(created)
            _match(reader, targets, strict)
            _check_destinations(reader, targets)
            dests, copies = _destinations(reader.entries(), targets, blobs)
            # every stored tensor: those without a target are read for their checksums
            wanted: dict[str, torch.Tensor | None] = {t.name: dests.get(t.name) for t in reader.header.tensors}
        reader.stream(wanted, checksum=checksum, progress=progress)
        with torch.no_grad():
            for target, source in copies:
                copyable(target).copy_(copyable(source))
        with _gc.paused():
            return reader.rebuild(lambda entry: targets.get(entry.path))
