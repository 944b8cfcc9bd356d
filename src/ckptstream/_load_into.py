"""load_into: fill the tensors of a live state in place from a checkpoint.

Everything is matched and checked (keys, shapes, dtypes) before a single byte is written. Each
tensor of the file streams straight into its target; only storage shared in the file by
*different* views (rare: a tensor saved with an overlapping view of itself) goes through a
temporary of that storage's size on the target's device.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ._checkpoint import Checkpoint, open_checkpoint
from ._errors import StateMismatchError, StateMismatchWarning
from ._settings import resolve
from ._structure import Path, make_view, path_str, unflatten, walk


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device, a.data_ptr(), a.dtype, a.shape, a.stride()) == (b.device, b.data_ptr(), b.dtype, b.shape, b.stride())


def _match(ck: Checkpoint, targets: dict[Path, torch.Tensor], strict: bool) -> None:
    """Raise one StateMismatchError listing every problem; warn about skipped keys if not strict."""
    missing = [path_str(p) for p in targets if p not in ck.leaves]
    unexpected = [path_str(p) for p in ck.leaves if p not in targets]
    infos = {t.name: t for t in ck.header.tensors}
    wrong = []
    for leaf, t in targets.items():
        if leaf in ck.leaves:
            file = ck.views.get(leaf) or infos[ck.leaves[leaf]["tensor"]]
            dtype, shape = file.dtype, file.shape
            if (t.dtype, tuple(t.shape)) != (dtype, shape):
                wrong.append(f"{path_str(leaf)}: the file has {dtype} {list(shape)}, the state {t.dtype} {list(t.shape)}")
    problems = [f"shape/dtype mismatch: {w}" for w in wrong]
    if strict:
        problems += [f"missing from the file: {m}" for m in missing]
        problems += [f"in the file but not in the state: {u}" for u in unexpected]
    if problems:
        hint = "" if not strict or wrong else " (strict=False loads the keys both sides have)"
        raise StateMismatchError(f"{ck.path} does not match the state{hint}:\n  " + "\n  ".join(problems))
    if missing or unexpected:
        warnings.warn(
            StateMismatchWarning(f"load_into({ck.path!r}, strict=False) skipped {len(missing)} missing key(s) "
                                 f"{missing[:5]} and {len(unexpected)} unexpected key(s) {unexpected[:5]}",
                                 missing, unexpected),
            stacklevel=3,
        )


def load_into(state: Any, path: str | os.PathLike[str], *, strict: bool = True, verify: bool = True,
              progress: bool = False, buffer_size: int | None = None, num_buffers: int | None = None) -> Any:
    """Fill the tensors of ``state`` in place (same storage, on their own devices) from a checkpoint.

    Args:
        state: a state of the same structure as the saved one (e.g. ``{"model":
            model.state_dict(), ...}``); its tensors are the destinations.
        path: the checkpoint file.
        strict: with True, any missing key, unexpected key, shape or dtype mismatch raises
            StateMismatchError before anything is written. With False, keys on one side only
            are skipped and listed in a ``StateMismatchWarning`` (with ``.missing`` and
            ``.unexpected``); shape and dtype mismatches still raise.
        verify: compare every tensor with its stored CRC-32C after reading it (a mismatch
            raises CorruptCheckpointError; the targets then hold the file's unverified bytes).
        progress: show a progress bar on stderr.
        buffer_size, num_buffers: override ``ckptstream.settings`` for this call.

    Returns:
        The file's structure with its non-tensor leaves (step, param_groups, ...) and the
        given tensors at their places; file tensors the state lacks (strict=False) are None.

    Example:
        >>> loaded = ckptstream.load_into({"model": model.state_dict(), "step": 0}, "ckpt.safetensors")
        >>> step = loaded["step"]
    """
    cfg = resolve(buffer_size=buffer_size, num_buffers=num_buffers)
    targets = {p: v for p, v in walk(state) if isinstance(v, torch.Tensor)}
    with open_checkpoint(path) as ck:
        _match(ck, targets, strict)
        dests: dict[str, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, loaded source) after the read
        for leaf, node in ck.leaves.items():
            if leaf in targets and leaf not in ck.views:
                name = node["tensor"]
                if name in dests and not _same_memory(dests[name], targets[leaf]):
                    copies.append((targets[leaf], dests[name]))  # the same tensor saved twice
                dests.setdefault(name, targets[leaf])
        sizes = {t.name: t.nbytes for t in ck.header.tensors}
        for leaf, view in ck.views.items():
            if leaf in targets and view.base not in dests:
                dests[view.base] = torch.empty(sizes[view.base], dtype=torch.uint8, device=targets[leaf].device)
        for leaf, view in ck.views.items():
            if leaf in targets:
                source = make_view(dests[view.base], view)
                if not _same_memory(source, targets[leaf]):
                    copies.append((targets[leaf], source))
        ck.read(dests, cfg, verify, progress)
        with torch.no_grad():
            for target, source in copies:
                target.copy_(source)
        return unflatten(ck.tree, lambda leaf, node: targets.get(leaf), ck.path)
