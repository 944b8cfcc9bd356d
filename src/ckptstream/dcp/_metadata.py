"""A DCP checkpoint's ``.metadata``: what each chunk's storage record holds, its atomic write,
and a read that runs no code from the file.

DCP's metadata is a pickle of ``torch.distributed.checkpoint.metadata.Metadata`` (the global
shapes, the chunks of every tensor, the non-tensor values' names, the planner's data); each
chunk's ``storage_data`` is a ``StoredChunk`` here. The file is written last, by the
coordinator, once every rank's file is durable: a directory without it is not a checkpoint.
Loading unpickles it with ``_pickles.SafeUnpickler`` and ``METADATA``, the exact set of what
DCP's writers (and ours) put there, so a crafted ``.metadata`` cannot run code; then every
chunk's file must be a plain name in the checkpoint's directory. ``trust_metadata=True`` is a
plain unpickle, for checkpoints whose planner stored other classes.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
from typing import Any

from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from .._errors import CorruptCheckpointError, UnsupportedStorageError, UnsupportedTypeError
from .._storage import storage_for
from . import _pickles

METADATA_NAME = ".metadata"  # DCP's name, so tools that look for a finished checkpoint find it
FORMAT_VERSION = "1.0.0"  # DCP's metadata version of the layout we write
# DCP's metadata grows with the number of chunks (docs/dcp.md gives a size); this bound leaves
# room for jobs of thousands of ranks, and a larger file (a sparse one, say) is refused unread
MAX_METADATA_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """Where one saved chunk lies: ``length`` bytes at byte ``offset`` of ``relative_path``
    (a rank file in the checkpoint's directory), the tensor ``key`` of that file's safetensors
    table, and the CRC-32C of its bytes (None when saved without checksums).

    (Pickled into ``.metadata`` as ``ckptstream.dcp.StoredChunk``: keep the name and fields.)
    """

    relative_path: str
    offset: int
    length: int
    key: str
    crc: int | None = None

    @property
    def transform_descriptors(self) -> Any:
        """Asked for by torch's FileSystemReader (2.7+), which cannot read these chunks: it
        torch.loads each chunk, and these are a safetensors file's raw bytes."""
        raise UnsupportedTypeError(
            f"{self.relative_path}: this checkpoint was saved by ckptstream.dcp.StreamWriter, whose chunks are raw "
            "tensor bytes in safetensors files; torch's FileSystemReader (and format_utils.dcp_to_torch_save, which "
            "uses it) reads only torch.save'd chunks. Load it with ckptstream.dcp.StreamReader, convert it with "
            "ckptstream.dcp.dcp_to_torch_save, or read its tensors with torch's HuggingFaceStorageReader")


StoredChunk.__module__ = "ckptstream.dcp"  # its public home: stays valid wherever this module moves


def _storage_meta_class() -> dict[tuple[str, str], type]:
    kind = getattr(dcp_metadata, "StorageMeta", None)  # torch without it: DCP stores None
    return {} if kind is None else {("torch.distributed.checkpoint.metadata", "StorageMeta"): kind}


def _mem_format_encoding(value: Any) -> Any:
    """A member of DCP's memory-format enum by its value (how an Enum member pickles)."""
    encoding = dcp_metadata._MEM_FORMAT_ENCODING
    if type(value) is not int or value not in encoding._value2member_map_:
        raise _pickles.Refused(f"{value!r} is no member's value")
    return encoding(value)


def _path(kind: type[pathlib.PurePath]) -> Any:
    def make(*parts: Any) -> pathlib.PurePath:  # a path object: nothing opens it
        if not all(isinstance(p, str) for p in parts):
            raise _pickles.Refused("a path takes strings")
        return kind(*parts)

    return make


_DCP = "torch.distributed.checkpoint.metadata"
_PATHS = {"PosixPath": pathlib.PosixPath, "PurePosixPath": pathlib.PurePosixPath,
          "WindowsPath": pathlib.PureWindowsPath, "PureWindowsPath": pathlib.PureWindowsPath}
# What DCP's writers (torch 2.4-2.13) and StreamWriter pickle into .metadata, and nothing else:
# DCP's dataclasses, the storage records of StreamWriter and of DCP's FileSystemWriter, the
# memory-format enum of TensorProperties' state, a FileSystemWriter's path (pathlib moved its
# classes into pathlib._local in Python 3.13), and _pickles.PLAIN's sizes, dtypes and containers.
METADATA = _pickles.PLAIN | _pickles.Allowed(
    classes={
        **{(_DCP, name): getattr(dcp_metadata, name) for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex")},
        **_storage_meta_class(),
        ("ckptstream.dcp", "StoredChunk"): StoredChunk,
        ("ckptstream.dcp._metadata", "StoredChunk"): StoredChunk,  # its name in earlier checkpoints
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    },
    calls={
        (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format_encoding,
        **{(module, name): _path(kind) for name, kind in _PATHS.items() for module in ("pathlib", "pathlib._local")},
    },
    values={},
)  # fmt: skip


def checkpoint_folder(path: str | os.PathLike[str]) -> str:
    """``path`` as the writer and the reader keep it; a URL that no storage serves raises
    UnsupportedStorageError (naming it and what to install) here, before DCP plans anything."""
    text = os.fspath(path)
    storage_for(text)
    return text


def metadata_name(rank: int | None) -> str:
    """``.metadata``, or a rank's own ``__{rank}.metadata`` when ranks save without collectives."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def write_metadata(directory: str, metadata: Metadata, rank: int | None) -> str:
    """Pickle ``metadata`` into the checkpoint's directory atomically (temp, fsync, rename,
    directory fsync); returns its path."""
    storage = storage_for(directory)
    path = storage.join(directory, metadata_name(rank))
    storage.write_small(path, _pickles.dumps(metadata))
    return path


def read_metadata(directory: str, rank: int | None, *, trusted: bool) -> Metadata:
    """The unpickled ``.metadata`` (or ``__{rank}.metadata``) of the checkpoint in ``directory``,
    its chunks' files checked to be plain names in the directory."""
    path = storage_for(directory).join(directory, metadata_name(rank))
    data = _read_file(path, directory, rank)
    if trusted:  # the caller vouched for the file
        try:
            metadata = _pickles.loads_trusted(data)
        except Exception as e:  # a truncated or damaged pickle fails in many ways
            raise CorruptCheckpointError(f"{path}: the checkpoint's metadata cannot be read ({type(e).__name__}: "
                                         f"{e}); it is damaged, or not a DCP checkpoint") from e
    else:
        metadata = _pickles.loads(data, METADATA, path, "the checkpoint's metadata")
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    check_storage(metadata, path)
    return metadata


def _read_file(path: str, directory: str, rank: int | None) -> bytes:
    """The bytes of a regular file, opened without blocking (a FIFO, a device, a directory
    named .metadata is refused) and at most MAX_METADATA_BYTES long."""
    storage = storage_for(directory)
    try:
        return storage.read_small(path, MAX_METADATA_BYTES)
    except FileNotFoundError as e:
        what = "" if storage.exists(directory) else " (the directory does not exist)"
        raise FileNotFoundError(e.errno, f"no {metadata_name(rank)}{what}: not a complete DCP checkpoint (a save "
                                         "that did not finish leaves none); load an earlier checkpoint", path) from e
    except OSError as e:
        if e.errno == errno.EFBIG:
            raise CorruptCheckpointError(f"{path}: {e.strerror} (the bound of a DCP checkpoint's metadata); it is "
                                         "damaged or not DCP's metadata") from e
        if e.errno == errno.EAGAIN:
            raise CorruptCheckpointError(f"{path}: {e.strerror}") from e
        if e.errno not in (errno.EINVAL, errno.EISDIR):  # not a regular file
            raise
        raise CorruptCheckpointError(f"{path}: {e.strerror}; a DCP checkpoint's metadata is a regular file") from e


def is_plain_name(name: object) -> bool:
    """A file name in a directory: not a path (no separator), not empty, '.' or '..', no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and os.sep not in name
            and (os.altsep is None or os.altsep not in name))


def check_storage(metadata: Metadata, path: str) -> None:
    """Every chunk's storage record names a file of the checkpoint's directory by a plain name:
    a record pointing out of it (``../x``, ``/etc/x``, ``a/b``) is refused before anything is
    read or listed."""
    data = metadata.storage_data
    if not isinstance(data, dict):
        return  # not a file writer's (StreamReader says so); nothing to list
    for index, record in data.items():
        name = getattr(record, "relative_path", None)
        if isinstance(record, (StoredChunk, _StorageInfo)) and not is_plain_name(name):
            fqn = getattr(index, "fqn", index)
            raise CorruptCheckpointError(
                f"{path}: the chunk of {fqn!r} is stored in {name!r}, which is not a file name in the checkpoint's "
                "directory (a path out of it, or no name); the metadata is crafted or damaged")


class CheckpointDirectory:
    """What StreamWriter and StreamReader share: a checkpoint is a folder, ``path``: a local
    directory, or the URL of a folder of any storage ckptstream has (``s3://bucket/run/step-100``,
    a registered scheme)."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether a storage serves ``checkpoint_id`` (DCP asks when it picks a writer or
        reader for a ``checkpoint_id`` alone): every local path, and the URLs of the schemes
        that ``storage_for`` can serve."""
        try:
            storage_for(os.fspath(checkpoint_id))
        except UnsupportedStorageError:
            return False
        return True
