"""ckptstream: stream training state between GPU memory and disk through a few pinned buffers."""

from ._checkpoint.load import load, open, read_metadata, verify
from ._checkpoint.load_into import load_into
from ._checkpoint.reader import CheckpointReader, TensorEntry, TensorSlice
from ._checkpoint.save import save
from ._checkpoint.save_async import AsyncMode, SaveHandle, save_async
from ._checkpoint.transfer import device_to_file, file_to_device
from ._engine import release_staging, staging_bytes
from ._errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointNotSavedError,
    CheckpointTimeoutError,
    CkptStreamError,
    ConnectionLostError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ExportError,
    IncompleteCheckpointError,
    NoCredentialsError,
    ObjectNotFoundError,
    ObjectStoreError,
    SnapshotFallbackWarning,
    StateMismatchError,
    StateMismatchWarning,
    ThrottledError,
    TruncatedFileError,
    UnsupportedStorageError,
    UnsupportedTypeError,
)
from ._export.export import HFExport, export_hf
from ._manager.manager import CheckpointManager, StepCheck, check_step, check_steps
from ._settings import INHERIT, DirectIO, Settings, current_settings, settings

__version__ = "0.1.0"

__all__ = [
    "AsyncMode",
    "INHERIT",
    "AccessDeniedError",
    "BucketNotFoundError",
    "CheckpointManager",
    "CheckpointNotSavedError",
    "CheckpointTimeoutError",
    "CheckpointReader",
    "CkptStreamError",
    "ConnectionLostError",
    "CorruptCheckpointError",
    "DirectIO",
    "DirectoryLockedError",
    "ExportError",
    "HFExport",
    "IncompleteCheckpointError",
    "NoCredentialsError",
    "ObjectNotFoundError",
    "ObjectStoreError",
    "SaveHandle",
    "Settings",
    "SnapshotFallbackWarning",
    "StepCheck",
    "StateMismatchError",
    "StateMismatchWarning",
    "TensorEntry",
    "TensorSlice",
    "ThrottledError",
    "TruncatedFileError",
    "UnsupportedStorageError",
    "UnsupportedTypeError",
    "current_settings",
    "device_to_file",
    "export_hf",
    "file_to_device",
    "check_step",
    "check_steps",
    "load",
    "load_into",
    "open",
    "read_metadata",
    "release_staging",
    "save",
    "save_async",
    "settings",
    "staging_bytes",
    "verify",
]
