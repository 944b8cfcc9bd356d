"""Small tools around DCP checkpoints: per-rank shards as DTensors, a checkpoint's files, and
the conversion to one ``torch.save`` file that torch's ``format_utils`` does for its own."""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed as dist

from .._storage import Sink, storage_for
from . import _metadata


def as_sharded(state: Any, mesh: Any = None) -> Any:
    """``state`` (a nested dict / list of this rank's tensors) with every tensor of one or more
    dimensions wrapped as a DTensor sharded on dimension 0 over the ranks, without a copy: the
    global tensor is the ranks' tensors stacked in rank order, each rank holding its own. Every
    rank must hold tensors of the same shapes and dtypes under the same keys. 0-d tensors and
    other values stay as they are (DCP treats them as replicated: one rank's value is saved).

    For states that each rank holds as its own shard (ZeRO-style), so that DCP saves them
    and reshards them on load; loading into ``as_sharded(target)`` fills ``target`` in place.

    Args:
        mesh: a 1-D DeviceMesh over all ranks; default: one on the tensors' device type.
    """
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, Shard  # type: ignore[attr-defined]

    def wrap(node: Any) -> Any:
        nonlocal mesh
        if isinstance(node, torch.Tensor) and not isinstance(node, DTensor) and node.dim() > 0:
            if mesh is None:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh(node.device.type, (dist.get_world_size(),))
            shape = (node.shape[0] * mesh.size(), *node.shape[1:])
            return DTensor.from_local(node, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                      stride=_contiguous_strides(shape))
        if isinstance(node, dict):
            return type(node)((k, wrap(v)) for k, v in node.items())
        if isinstance(node, (list, tuple)):
            return type(node)(wrap(v) for v in node)
        return node

    return wrap(state)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The files of the DCP checkpoint in directory ``path`` (written by ``StreamWriter`` or by
    torch's ``FileSystemWriter``): its ``.metadata`` and every data file it records, sorted.

    Raises:
        CorruptCheckpointError: the metadata holds what DCP's never does (it is read as
            ``StreamReader`` reads it, running no code), a data file's name is not a plain name
            in the directory, or ``.metadata`` is not a regular file.
        FileNotFoundError: no ``.metadata`` (not a complete checkpoint).
    """
    directory = os.fspath(path)
    metadata = _metadata.read_metadata(directory, None, trusted=False)
    names = {getattr(chunk, "relative_path", None) for chunk in (metadata.storage_data or {}).values()}
    storage = storage_for(directory)
    paths = [storage.join(directory, n) for n in names if isinstance(n, str)]
    return sorted([storage.join(directory, _metadata.METADATA_NAME), *paths])


def dcp_to_torch_save(path: str | os.PathLike[str], torch_save_path: str | os.PathLike[str], *,
                      trust_metadata: bool = False) -> None:
    """Convert the checkpoint that ``StreamWriter`` saved in directory ``path`` into one
    ``torch.save`` file of the whole state (the global tensors, put together from every rank's
    chunks, and the non-tensor values), as torch's ``format_utils.dcp_to_torch_save`` does for
    checkpoints of its ``FileSystemWriter`` (its reader cannot read ours). The whole state is
    held in host memory, once; the file is published atomically.

    Args:
        trust_metadata: as for ``StreamReader`` (runs code the checkpoint's pickles name).

    Raises:
        CorruptCheckpointError, FileNotFoundError: as ``StreamReader`` (the first rank's error,
            not DCP's CheckpointException around it).

    Example:
        >>> ckptstream.dcp.dcp_to_torch_save("ckpt/step-100", "step-100.pt")
        >>> state = torch.load("step-100.pt", weights_only=True)
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ._reader import StreamReader

    # read first here, so that its errors come as they are (DCP 2.9+ turns them into assertions)
    _metadata.read_metadata(os.fspath(path), None, trusted=trust_metadata)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=StreamReader(path, trust_metadata=trust_metadata),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        errors = [error for error, _ in e.failures.values() if isinstance(error, Exception)]
        if len(errors) == 1:
            raise errors[0] from e
        raise
    target = os.fsdecode(torch_save_path)
    with storage_for(target).create(target) as sink, io.BufferedWriter(_Appender(sink), 1 << 20) as out:
        torch.save(state, out)


class _Appender(io.RawIOBase):
    """A write-only stream that appends to a sink (what ``torch.save`` writes to)."""

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self._sink, self._at = sink, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._sink.write_at(view, self._at)
        self._at += len(view)
        return len(view)

    def tell(self) -> int:
        return self._at
