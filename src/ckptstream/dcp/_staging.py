"""What ``dcp.async_save`` saves while training goes on: the staged state dict.

Three modes, the names of ``ckptstream.save_async``:
- "device": a snapshot on the tensors' own devices (a GPU tensor is cloned on its GPU, a CPU
  tensor in host memory; a DTensor's clone keeps its mesh and placements). The clones are
  queued on the caller's streams, so the caller may change the state as soon as the call
  returns; the writer then streams the clones through its few pinned buffers, so host memory
  stays bounded by the staging buffers whatever the state's size.
- "lazy": no copy at all; the writer streams from the live tensors, and the caller waits for
  ``StreamWriter.wait_staged()`` before changing them (before ``optimizer.step()``).
- "host": a full host copy (pinned where CUDA tensors are), what DCP's own stager does.
In every mode the containers and non-tensor values are copied at the call, so a later change
to a step counter or a learning rate cannot leak into the checkpoint.
"""

from __future__ import annotations

import copy
import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

# whether DCP's host-copy helpers (_create_cpu_state_dict, _copy_state_dict) copy DTensors
_HELPERS_COPY_DTENSORS = torch.__version__ >= "2.7"


class Staging(str, enum.Enum):
    """How ``dcp.async_save`` stages the state (see the module's docstring)."""

    DEVICE = "device"
    LAZY = "lazy"
    HOST = "host"

    @classmethod
    def parse(cls, value: object) -> Staging:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"staging must be one of {[m.value for m in cls]}, got {value!r}") from None


def _rebuild(state: Any, tensor: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]) -> Any:
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


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def stage(state_dict: dict[str, Any], mode: Staging) -> dict[str, Any]:
    """The staged copy of ``state_dict`` for ``mode``."""
    if mode is Staging.HOST:
        return _host_copy(state_dict)
    if mode is Staging.LAZY:
        lazy: dict[str, Any] = _rebuild(state_dict, _keep, {})
        return lazy
    try:
        staged: dict[str, Any] = _rebuild(state_dict, _clone, {})
    except torch.cuda.OutOfMemoryError as e:
        raise torch.cuda.OutOfMemoryError(
            f"staging='device' needs GPU memory for a copy of the state and ran short ({e}); use staging='lazy' "
            "(no copy: wait for StreamWriter.wait_staged() before changing the state) or staging='host'") from e
    return staged


def _host_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of every tensor in host memory (pinned when the state has CUDA tensors), through
    DCP's own helpers, which keep each DTensor's mesh and placements."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    # containers and non-tensor values copied; torch 2.4-2.6's helpers pass a DTensor through
    # uncopied (the staged state would be the live one), so there each DTensor is copied here
    plain = _rebuild(state_dict, _keep if _HELPERS_COPY_DTENSORS else _host_dtensor, {})
    on_cuda = any(t.is_cuda for t in tensors_of(plain))
    staged: dict[str, Any] = _create_cpu_state_dict(plain, pin_memory=on_cuda)
    _copy_state_dict(plain, staged, type_check=False)
    return staged


def _host_dtensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's copy in host memory (same mesh and placements); other tensors as they are."""
    if isinstance(getattr(t, "_local_tensor", None), torch.Tensor):
        return t.detach().to("cpu", copy=True)
    return t


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in a staged state (a DTensor as its local tensor)."""
    found: list[torch.Tensor] = []

    def visit(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            local = getattr(node, "_local_tensor", None)
            found.append(local if isinstance(local, torch.Tensor) else node)
        elif isinstance(node, dict):
            for v in node.values():
                visit(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                visit(v)

    visit(state)
    return found
