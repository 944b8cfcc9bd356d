"""Every error and warning that ckptstream raises for its users to catch, in one namespace.

One base, ``CkptStreamError``; each subclass also inherits the built-in it refines, so code that
catches ``ValueError`` or ``OSError`` keeps working. The object stores' errors are the
``ObjectStoreError`` family (an ``OSError``): each names the URL and the store's error code.

    >>> from ckptstream.errors import CorruptCheckpointError, ObjectNotFoundError
    >>> try:
    ...     state = ckptstream.load("s3://bucket/run/step-100.safetensors")
    ... except ObjectNotFoundError as e:
    ...     print("no such checkpoint:", e.url)

The same classes are importable from ``ckptstream`` itself; this module is the one place that
holds them all, the storages' (``LockHeldError``), the transfers' (``TransferCancelled``),
Lightning's and the benchmark's included.
"""

from ._engine.control import TransferCancelled
from ._errors import (
    AccelerateFolderError,
    AccessDeniedError,
    BenchError,
    BucketNotFoundError,
    CheckpointNotSavedError,
    CheckpointTimeoutError,
    ChecksumsMissingError,
    CkptStreamError,
    ConnectionLostError,
    CorruptCheckpointError,
    DeadlineExceededError,
    DirectoryLockedError,
    ExportError,
    IncompleteCheckpointError,
    NoCredentialsError,
    NotACheckpointError,
    ObjectNotFoundError,
    ObjectReplacedError,
    ObjectStoreError,
    SnapshotFallbackWarning,
    StateMismatchError,
    StateMismatchWarning,
    StorageOptionsError,
    ThreadStartError,
    ThrottledError,
    TrainerFolderError,
    TruncatedFileError,
    UnsupportedPathError,
    UnsupportedStorageError,
    UnsupportedTypeError,
)
from ._storage.base import LockHeldError

__all__ = [
    "AccelerateFolderError",
    "AccessDeniedError",
    "BenchError",
    "BucketNotFoundError",
    "CheckpointNotSavedError",
    "CheckpointTimeoutError",
    "ChecksumsMissingError",
    "CkptStreamError",
    "ConnectionLostError",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "DirectoryLockedError",
    "ExportError",
    "IncompleteCheckpointError",
    "LockHeldError",
    "NoCredentialsError",
    "NotACheckpointError",
    "ObjectNotFoundError",
    "ObjectReplacedError",
    "ObjectStoreError",
    "SnapshotFallbackWarning",
    "StateMismatchError",
    "StateMismatchWarning",
    "StorageOptionsError",
    "ThreadStartError",
    "ThrottledError",
    "TrainerFolderError",
    "TransferCancelled",
    "TruncatedFileError",
    "UnsupportedPathError",
    "UnsupportedStorageError",
    "UnsupportedTypeError",
]
