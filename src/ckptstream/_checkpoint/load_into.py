"""load_into: fill the tensors of a live state in place from a checkpoint.

Everything is matched and checked (keys, shapes, dtypes, destinations) before a single byte is
written. Each tensor of the file streams straight into its target; only storage shared in the
file by *different* views (rare: a tensor saved with an overlapping view of itself) goes through
a temporary of that storage's size on the target's device.

A state may hold many thousands of small tensors, so the checks take one pass over the targets
with a few attribute reads for the common one (a plain, contiguous, dense tensor), and build a
key's string only for a message.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import os
import re
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .. import _gc
from .._engine import PLAIN_TENSORS, check_tensor, copyable, empty_tensor, gpucrc, streamable
from .._errors import StateMismatchError, StateMismatchWarning
from .._format.flatten import walk
from .._format.structure import KeyPath, View, key_str, make_view
from .._settings import LegacyKeywords, Settings, per_call
from .load import checksum_argument, once_more_if_replaced
from .reader import CheckpointReader, Device, TensorEntry, target_device

if TYPE_CHECKING:
    from typing_extensions import Unpack

Entries = dict[KeyPath, TensorEntry]
Span = tuple[int, int, KeyPath]  # a target's memory: addresses start..end


def _memory(t: torch.Tensor) -> tuple[object, ...]:
    return t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _memory(a) == _memory(b)


@dataclasses.dataclass
class _Survey:
    """What one pass over the targets finds, in the targets' order."""

    missing: list[KeyPath] = dataclasses.field(default_factory=list)  # targets the file lacks
    wrong: list[KeyPath] = dataclasses.field(default_factory=list)  # targets of another dtype or shape
    unfit: list[str] = dataclasses.field(default_factory=list)  # why a target cannot take the file's bytes
    spans: list[Span] = dataclasses.field(default_factory=list)  # of the targets with elements


def _survey(targets: dict[KeyPath, torch.Tensor], entries: Entries) -> _Survey:
    """Match every target with its entry and check, for each the file has, that its bytes can
    land in it (see ``_check_target``), noting the addresses its memory spans."""
    found = _Survey()
    missing, wrong, spans, plain = found.missing, found.wrong, found.spans, PLAIN_TENSORS
    # streamable() of a plain tensor goes with these (is_quantized with the dtype: qint8, ...)
    itemsizes: dict[tuple[object, ...], int] = {}  # per (device, dtype, layout): 0 where not streamable
    for p, t in targets.items():
        e = entries.get(p)
        if e is None:
            missing.append(p)
            continue
        dtype = t.dtype
        if dtype != e.dtype or t.shape != e.shape:
            wrong.append(p)
        if type(t) in plain:
            device = t.device
            kind = (device, dtype, t.layout)
            esz = itemsizes.get(kind)
            if esz is None:
                esz = itemsizes[kind] = t.element_size() if streamable(t) else 0
            # contiguous with elements: no stride 0 over a dimension of several, no self-overlap, and
            # its memory is nbytes from its first element (nbytes is read once streamable: a sparse
            # tensor has none)
            if esz and (nbytes := t.nbytes) and t.is_contiguous() and not t.is_conj() and not t.is_neg():
                start = t.data_ptr()
                spans.append((start, start + nbytes, p))
                continue
        _check_target(p, t, found)
    return found


def _check_target(p: KeyPath, t: torch.Tensor, found: _Survey) -> None:
    """Any target: a dense CPU or CUDA tensor whose elements have memory of their own."""
    try:
        check_tensor(t, key_str(p), writable=True)
    except (TypeError, ValueError) as e:
        found.unfit.append(str(e))
    else:
        if _self_overlapping(t):
            found.unfit.append(f"{key_str(p)}: its elements share memory (strides {t.stride()}), so it cannot hold "
                               "distinct values")
    if t.numel() and t.layout == torch.strided:  # strides are never negative: element 0 comes first
        last = int(sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))) * t.element_size()
        found.spans.append((t.data_ptr(), t.data_ptr() + last + t.element_size(), p))


def _tied(targets: dict[KeyPath, torch.Tensor], entries: Entries, missing: list[KeyPath]) -> set[KeyPath]:
    """Targets the file lacks that are the very memory of a target it has: tied weights saved
    once (transformers' ``lm_head.weight`` is ``transformer.wte.weight``); filling one fills both."""
    if not any(targets[p].numel() for p in missing):
        return set()
    in_file = {_memory(t) for p, t in targets.items() if p in entries and t.numel()}
    return {p for p in missing if targets[p].numel() and _memory(targets[p]) in in_file}


def _match(path: str, entries: Entries, targets: dict[KeyPath, torch.Tensor], found: _Survey, strict: bool) -> None:
    """Raise one StateMismatchError listing every problem; warn about skipped keys if not strict."""
    tied = _tied(targets, entries, found.missing)
    missing = [key_str(p) for p in found.missing if p not in tied]
    in_both = len(targets) - len(found.missing)
    unexpected = [key_str(p) for p in entries if p not in targets] if in_both < len(entries) else []
    compiled = _compile_prefix(missing, unexpected)
    wrong = [f"{key_str(p)}: the file has {entries[p].dtype} {list(entries[p].shape)}, the state "
             f"{targets[p].dtype} {list(targets[p].shape)}" for p in found.wrong]
    problems = [f"shape/dtype mismatch: {w}" for w in wrong]
    if strict:
        problems += [f"missing from the file: {m}" for m in missing]
        problems += [f"in the file but not in the state: {u}" for u in unexpected]
    if problems:
        hint = "" if not strict or wrong else " (strict=False loads the keys both sides have)"
        hint = f": {compiled}" if compiled and not wrong else hint
        raise StateMismatchError(f"{path} does not match the state{hint}:\n  " + "\n  ".join(problems))
    if missing or unexpected:
        warnings.warn(
            StateMismatchWarning(f"load_into({path!r}, strict=False) skipped {len(missing)} missing key(s) "
                                 f"{missing[:5]} and {len(unexpected)} unexpected key(s) {unexpected[:5]}"
                                 + (f": {compiled}" if compiled else ""), missing, unexpected),
            stacklevel=5,  # _match, read, once_more_if_replaced, load_into, the caller
        )


# torch.compile's module holds the original as ``_orig_mod``: its state_dict()'s keys start so
_COMPILED = re.compile(r"(?:^|(?<=\.))_orig_mod\.")


def _compile_prefix(missing: list[str], unexpected: list[str]) -> str:
    """What to say where every key on one side differs from one on the other by torch.compile's
    ``_orig_mod.`` alone (a compiled model's state_dict() has it, the original's does not)."""
    if not missing or len(missing) != len(unexpected):
        return ""
    in_file = [bool(_COMPILED.search(k)) for k in unexpected]
    in_state = [bool(_COMPILED.search(k)) for k in missing]
    if not ((all(in_file) and not any(in_state)) or (all(in_state) and not any(in_file))):
        return ""
    if {_COMPILED.sub("", k) for k in missing} != {_COMPILED.sub("", k) for k in unexpected}:
        return ""
    if all(in_file):
        return ("the keys differ by torch.compile's '_orig_mod.' alone, which the file's have: it was saved from a "
                "compiled model; load into the compiled model's state_dict() (torch.compile(model).state_dict() "
                "holds the same tensors under those keys)")
    return ("the keys differ by torch.compile's '_orig_mod.' alone, which the state's have: it is a compiled "
            "model's; load into compiled._orig_mod.state_dict() (the same tensors, keyed as in the file)")


def _check_destinations(path: str, entries: Entries, targets: dict[KeyPath, torch.Tensor], found: _Survey) -> None:
    """Raise one StateMismatchError, before a byte is written, for every target the file's bytes
    cannot land in: one that is not a dense CPU or CUDA tensor, whose elements share memory
    (an expanded view), or whose memory overlaps another target's (unless both are the same
    tensor, or views the file stores over the same bytes)."""
    problems = found.unfit + _overlaps(found.spans, targets, entries)
    if problems:
        raise StateMismatchError(f"{path}: the state has tensors the checkpoint cannot be loaded into, "
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


def _overlaps(spans: list[Span], targets: dict[KeyPath, torch.Tensor], entries: Entries) -> list[str]:
    """Pairs of targets on one device whose memory overlaps (aliasing storages included): a
    sweep over the ranges by address that holds every range still open, as one may reach past
    several that follow it. Of targets that are the same memory and stored alike, one stays
    open: the others would clash with the same ones."""
    spans.sort(key=operator.itemgetter(0))
    reach = itertools.accumulate((end for _, end, _ in spans), max)
    if not any(map(operator.lt, (start for start, _, _ in itertools.islice(spans, 1, None)), reach)):
        return []  # no range starts before an earlier one ends
    problems = []
    open_: list[Span] = []
    for start, end, b in spans:
        open_ = [r for r in open_ if r[1] > start]
        twin, device, view = False, targets[b].device, _view_of(entries[b])
        for _, _, a in open_:
            if targets[a].device != device:
                continue
            if _same_memory(targets[a], targets[b]):
                twin = twin or _view_of(entries[a]) == view
            elif _view_of(entries[a]) is None or _view_of(entries[a]) != view:
                problems.append(f"{key_str(a)} and {key_str(b)} overlap in memory, but the file holds them "
                                "apart: loading one would overwrite the other")
        if not twin:
            open_.append((start, end, b))
    return problems


def _view_of(e: TensorEntry) -> str | None:
    """The stored bytes a view entry is a view of: views of the same are written consistently."""
    return e.stored_as if e.view is not None else None


def _destinations(entries: Iterable[TensorEntry], targets: dict[KeyPath, torch.Tensor], blobs: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Where each stored tensor streams to, and the copies to make once it is read and verified:
    the same tensor saved twice, and views of shared storage (read into a temporary, or into the
    ``blobs`` created for them)."""
    dests: dict[str, torch.Tensor] = dict(blobs)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, loaded source)
    views: list[tuple[TensorEntry, View, torch.Tensor]] = []
    for e in entries:
        target = targets.get(e.path)
        if target is None:
            continue
        if e.view is not None:
            views.append((e, e.view, target))  # once every stored tensor has its destination
            continue
        held = dests.get(e.stored_as)
        if held is None:
            dests[e.stored_as] = target
        elif not _same_memory(held, target):
            copies.append((target, held))
    for e, view, target in views:
        if e.stored_as not in dests:
            dests[e.stored_as] = torch.empty(e.end - e.offset, dtype=torch.uint8, device=target.device)
        source = make_view(dests[e.stored_as], view)
        if not _same_memory(source, target):
            copies.append((target, source))
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


def _created(reader: CheckpointReader, state: Any, targets: dict[KeyPath, torch.Tensor], device: Device | None
             ) -> tuple[dict[KeyPath, torch.Tensor], dict[str, torch.Tensor]]:
    """New tensors for the file's tensors that ``state`` lacks below an empty container of it,
    and the blobs of shared bytes that those stored as views are views of (each of its stored
    size: a view's shape may describe more)."""
    absent = [e for e in reader.entries() if e.path not in targets] if device is not None else []
    empty = _empty_containers(state) if absent else set()
    wanted = [e for e in absent if empty and any(e.path[:i] in empty for i in range(len(e.path)))]
    if not wanted or device is None:  # None: wanted is empty (absent was), said again for the type
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


def load_into(state: Any, path: str | os.PathLike[str], *, strict: bool = True, device: Device | None = "auto",
              checksum: bool = True, progress: bool = False, require_checksums: bool = False,
              verify: bool | None = None, settings: Settings | None = None, **legacy: Unpack[LegacyKeywords]) -> Any:
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
        require_checksums: refuse, before a byte is written, a file that stores no checksums
            (a file without them otherwise loads unchecked; see docs/reliability.md).
        settings: the ``Settings`` of this call (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=64 << 20)``); None: those in force (see
            ``ckptstream.settings``). 0.1.0's per-call ``buffer_size`` and
            ``num_buffers`` are deprecated in its favour.

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
    cfg = per_call("load_into", settings, legacy)
    # the collector paused throughout, as in load: a few objects per tensor, none in cycles
    with _gc.paused():
        given = {p: v for p, v in walk(state) if isinstance(v, torch.Tensor)}
        gpu = next((t.device for t in given.values() if t.is_cuda), None) if checksum else None

        def read() -> Any:  # the whole of it again where the object is replaced meanwhile
            with CheckpointReader(path, cfg, require_checksums=require_checksums) as reader:
                entries = {e.path: e for e in reader.entries()}
                created, blobs = _created(reader, state, given, device)
                targets = {**given, **created}
                found = _survey(targets, entries)
                _match(reader.path, entries, targets, found, strict)
                _check_destinations(reader.path, entries, targets, found)
                dests, copies = _destinations(entries.values(), targets, blobs)
                # every stored tensor: those without a target are read for their checksums
                wanted: dict[str, torch.Tensor | None] = {t.name: dests.get(t.name) for t in reader.header.tensors}
                reader.stream(wanted, checksum=checksum, progress=progress)
                with torch.no_grad():
                    for target, source in copies:
                        copyable(target).copy_(copyable(source))
                return reader.rebuild(lambda entry: targets.get(entry.path))

        with gpucrc.built_meanwhile(gpu):
            return once_more_if_replaced(read)
