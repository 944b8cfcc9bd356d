"""FSDP2 under Accelerate: its own ``save_state`` / ``load_state``, with the sharded model and
optimizer states going through ``ckptstream.dcp``.

Accelerate saves an FSDP2 model and optimizer with ``torch.distributed.checkpoint`` in
``save_fsdp_model`` / ``save_fsdp_optimizer`` (``accelerate.utils.fsdp_utils``), each building
its storage with ``dist_cp.FileSystemWriter(folder)`` (``FileSystemReader`` on load) and no
argument to pass another. So, for the length of one ``save_state`` / ``load_state`` call, those
two names of ``torch.distributed.checkpoint`` stand for ``StreamWriter`` / ``StreamReader``:
the folders (``pytorch_model_fsdp_<i>``, ``optimizer_<i>``) then hold one ckptstream file per
rank and DCP's ``.metadata``. The other parts (schedulers, RNG states, samplers, registered
objects) stay Accelerate's files, as do its folder naming and ``total_limit``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dist_cp

from ..dcp import StreamReader, StreamWriter

__all__ = ["routes_through_dcp", "through_dcp"]

_swap = threading.Lock()  # the two names are process-wide: one call swaps them at a time


def routes_through_dcp(accelerator: Any) -> bool:
    """An FSDP2 accelerator saving sharded state: the case Accelerate writes with DCP."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    kind = getattr(plugin, "state_dict_type", None)
    return (getattr(plugin, "fsdp_version", None) == 2
            and getattr(kind, "name", str(kind)).upper().endswith("SHARDED_STATE_DICT"))


@contextmanager
def through_dcp(checksum: bool) -> Iterator[None]:
    """``dist_cp.FileSystemWriter`` / ``FileSystemReader`` made ckptstream's for the block."""

    def writer(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> StreamWriter:
        return StreamWriter(path, checksum=checksum)

    def reader(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> StreamReader:
        return StreamReader(path, checksum=checksum)

    with _swap:
        saved = dist_cp.FileSystemWriter, dist_cp.FileSystemReader
        dist_cp.FileSystemWriter, dist_cp.FileSystemReader = writer, reader  # type: ignore[misc,assignment]
        try:
            yield
        finally:
            dist_cp.FileSystemWriter, dist_cp.FileSystemReader = saved  # type: ignore[misc]
