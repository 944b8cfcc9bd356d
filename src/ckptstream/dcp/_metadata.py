"""A DCP checkpoint's ``.metadata``: what each chunk's storage record holds, its atomic write,
and a read that runs no code from the file.

DCP's metadata is a pickle of ``torch.distributed.checkpoint.metadata.Metadata`` (the global
shapes, the chunks of every tensor, the non-tensor values' names, the planner's data); each
chunk's ``storage_data`` is a ``StoredChunk`` here. The file is written last, by the
coordinator, once every rank's file is durable: a directory without it is not a checkpoint.
Loading unpickles it with an allow-list of the classes such metadata holds, so a crafted
``.metadata`` cannot run code (``trust_metadata=True`` lifts that for checkpoints whose
planner stored other classes).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .. import _fileio
from .._errors import CorruptCheckpointError
from .._publish import atomic_file

METADATA_NAME = ".metadata"  # DCP's name, so tools that look for a finished checkpoint find it
FORMAT_VERSION = "1.0.0"  # DCP's metadata version of the layout we write


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """Where one saved chunk lies: ``length`` bytes at byte ``offset`` of ``relative_path``
    (a rank file in the checkpoint's directory), the tensor ``key`` of that file's safetensors
    table, and the CRC-32C of its bytes (None when saved without checksums).

    (Pickled into ``.metadata`` under this module's path: keep the name and fields.)
    """

    relative_path: str
    offset: int
    length: int
    key: str
    crc: int | None = None


def metadata_name(rank: int | None) -> str:
    """``.metadata``, or a rank's own ``__{rank}.metadata`` when ranks save without collectives."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def write_metadata(directory: str, metadata: Metadata, rank: int | None) -> str:
    """Pickle ``metadata`` into the checkpoint's directory atomically (temp, fsync, rename,
    directory fsync); returns its path."""
    path = os.path.join(directory, metadata_name(rank))
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    with atomic_file(path) as file:
        _fileio.pwrite_all(file.fd, memoryview(data), 0, file.path)
    return path


# What DCP's metadata holds: its own dataclasses, torch.Size, dtypes, layouts and memory
# formats, the checkpoint's path, and the storage records of ours (and of DCP's file writer,
# only so that such a checkpoint gets a clear error instead of a refusal to unpickle).
_ALLOWED_MODULES = frozenset({"torch.distributed.checkpoint.metadata"})
_ALLOWED = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    (__name__, "StoredChunk"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})  # fmt: skip
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise CorruptCheckpointError(
            f"{self._path}: the metadata refers to {module}.{name}, which is not among the classes a DCP "
            "checkpoint's metadata holds, so loading it could run code from the file; if you trust this "
            "checkpoint (a custom planner that stores other objects), pass StreamReader(..., trust_metadata=True)")


def read_metadata(directory: str, rank: int | None, *, trusted: bool) -> Metadata:
    """The unpickled ``.metadata`` (or ``__{rank}.metadata``) of the checkpoint in ``directory``."""
    path = os.path.join(directory, metadata_name(rank))
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        what = "" if os.path.isdir(directory) else " (the directory does not exist)"
        raise FileNotFoundError(e.errno, f"no {metadata_name(rank)}{what}: not a complete DCP checkpoint (a save "
                                         "that did not finish leaves none); load an earlier checkpoint", path) from e
    try:
        # trusted: the caller vouched for the file
        metadata = pickle.loads(data) if trusted else _MetadataUnpickler(io.BytesIO(data), path).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # a truncated or damaged pickle fails in many ways
        raise CorruptCheckpointError(f"{path}: the checkpoint's metadata cannot be read ({type(e).__name__}: "
                                     f"{e}); it is damaged, or not a DCP checkpoint") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class CheckpointDirectory:
    """What StreamWriter and StreamReader share: a checkpoint is a local directory, ``path``."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in os.fspath(checkpoint_id)
