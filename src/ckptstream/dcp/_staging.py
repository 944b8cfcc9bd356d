"""What ``dcp.async_save`` saves while training goes on: the staged state dict.

The tensors are captured by the one capture of background saves (``ckptstream._checkpoint.capture``, as
``save_async`` captures them), in its modes:
- "device": a snapshot on the tensors' own devices (a GPU tensor is cloned on its GPU, a CPU
  tensor in host memory; a DTensor's clone keeps its mesh and placements). The clones are
  queued on the caller's streams, so the caller may change the state as soon as the call
  returns; the writer then streams the clones through its few pinned buffers, so host memory
  stays bounded by the staging buffers whatever the state's size. Where the snapshot does not
  fit, staging fails (DCP cannot wait for a live read after ``async_save`` returns).
- "lazy": no copy (CPU tensors of up to 1 MiB excepted); the writer streams from the live
  tensors, and the caller waits for ``StreamWriter.wait_staged()`` before changing them (before
  ``optimizer.step()``).
- "host": a full host copy (pinned where CUDA tensors are), what DCP's own stager does. The
  device-to-host copies run on a side stream beside the caller's work (as for ``save_async``):
  the process's guard orders an optimizer's update and a training-mode forward that updates a
  saved buffer after them, ``StreamWriter.wait_staged()`` orders the caller's current stream;
  the writer waits for the copies before reading them.
In every mode the containers and non-tensor values are copied at the call, so a later change
to a step counter or a learning rate cannot leak into the checkpoint.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .._checkpoint.capture import AsyncMode, Captured, capture


class _Slot(int):
    """Where the staged state holds the captured tensor of this index."""


def _rebuild(state: Any, tensor: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """``state`` with each tensor replaced by ``tensor(t)`` (a tensor met twice, once), the
    containers rebuilt and every other value deep-copied."""
    if isinstance(state, torch.Tensor):
        key = id(state)
        if key not in memo:
            memo[key] = tensor(state)
        return memo[key]
    if isinstance(state, Stateful):  # as DCP does before staging (torch 2.4-2.8 stage first)
        state = state.state_dict()
    if isinstance(state, dict):
        items = [(k, _rebuild(v, tensor, memo)) for k, v in state.items()]
        return OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
    if isinstance(state, list):
        return [_rebuild(v, tensor, memo) for v in state]
    if isinstance(state, tuple):
        values = [_rebuild(v, tensor, memo) for v in state]
        return type(state)(*values) if hasattr(state, "_fields") else tuple(values)
    return copy.deepcopy(state)


def _fill(node: Any, tensors: list[torch.Tensor]) -> Any:
    """The rebuilt skeleton with each slot replaced by its tensor."""
    if isinstance(node, _Slot):
        return tensors[node]
    if isinstance(node, dict):
        return type(node)((k, _fill(v, tensors)) for k, v in node.items())
    if isinstance(node, list):
        return [_fill(v, tensors) for v in node]
    if isinstance(node, tuple):
        values = [_fill(v, tensors) for v in node]
        return type(node)(*values) if hasattr(node, "_fields") else tuple(values)
    return node


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory a save reads: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).detach()


def _like(original: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in the place of ``original``: a DTensor of the same mesh, placements, shape and
    strides around it, or ``local`` itself."""
    if not isinstance(getattr(original, "_local_tensor", None), torch.Tensor):
        return local
    dtensor: Any = original
    wrapped: torch.Tensor = type(dtensor).from_local(local, dtensor.device_mesh, dtensor.placements, run_check=False,
                                                     shape=dtensor.shape, stride=dtensor.stride())
    return wrapped


def stage(state_dict: dict[str, Any], mode: AsyncMode) -> tuple[dict[str, Any], Captured]:
    """The staged copy of ``state_dict`` for ``mode``, and what its capture says (the CUDA
    ordering point of the captured tensors, the copies to wait for before reading them)."""
    found: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _Slot:
        found.append(t)
        return _Slot(len(found) - 1)

    skeleton = _rebuild(state_dict, slot, {})
    captured = capture([_local(t) for t in found], mode, fall_back=False)
    staged: dict[str, Any] = _fill(skeleton, [_like(t, c) for t, c in zip(found, captured.tensors, strict=True)])
    return staged, captured
