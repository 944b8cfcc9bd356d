"""ckptstream: stream training state between GPU memory and disk through a few pinned buffers."""

from ._async import CheckpointNotSavedError, SaveHandle, SnapshotFallbackWarning, save_async
from ._engine import release_staging, staging_bytes
from ._errors import (
    CkptStreamError,
    CorruptCheckpointError,
    StateMismatchError,
    StateMismatchWarning,
    TruncatedFileError,
    UnsupportedStorageError,
    UnsupportedTypeError,
)
from ._export import HFExport, export_hf
from ._export_plan import ExportError
from ._load import load, open, read_metadata, verify
from ._load_into import load_into
from ._manager import (
    CheckpointManager,
    CheckpointTimeoutError,
    DirectoryLockedError,
    IncompleteCheckpointError,
    StepCheck,
    check_step,
    check_steps,
)
from ._reader import CheckpointReader, TensorEntry, TensorSlice
from ._save import save
from ._settings import INHERIT, DirectIO, Settings, current_settings, settings
from ._transfer import device_to_file, file_to_device

__version__ = "0.1.0"

__all__ = [
    "INHERIT",
    "CheckpointManager",
    "CheckpointNotSavedError",
    "CheckpointTimeoutError",
    "CheckpointReader",
    "CkptStreamError",
    "CorruptCheckpointError",
    "DirectIO",
    "DirectoryLockedError",
    "ExportError",
    "HFExport",
    "IncompleteCheckpointError",
    "SaveHandle",
    "Settings",
    "SnapshotFallbackWarning",
    "StepCheck",
    "StateMismatchError",
    "StateMismatchWarning",
    "TensorEntry",
    "TensorSlice",
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
