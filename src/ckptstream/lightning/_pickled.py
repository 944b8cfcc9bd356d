"""The one place where StreamCheckpointIO pickles: values the user opted into with
``allow_pickle=True``, stored as uint8 tensors, and unpickled only under the same opt-in
(``_values.restore`` refuses them otherwise, naming their key paths)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["dumps", "loads"]


def dumps(value: Any) -> torch.Tensor:
    """``value`` pickled, as a 1-d uint8 tensor."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def loads(tensor: torch.Tensor) -> Any:
    """The value pickled in ``tensor`` (this runs code chosen by whoever wrote the file)."""
    return pickle.loads(bytes(tensor.cpu().tolist()))
