"""ckptstream: stream training state between GPU memory and disk through a few pinned buffers."""

from typing import TYPE_CHECKING

from ._checkpoint.load import load, read_metadata, verify
from ._checkpoint.load import open as open  # public, but not in __all__ (see there)
from ._checkpoint.load_into import load_into
from ._checkpoint.reader import CheckpointReader, Device, TensorEntry, TensorSlice
from ._checkpoint.save import save
from ._checkpoint.save_async import AsyncMode, SaveHandle, save_async
from ._checkpoint.snapshot import host_snapshot_bytes, release_host_snapshot, warm_host_snapshot
from ._checkpoint.transfer import device_to_file, file_to_device
from ._engine import release_staging, staging_bytes
from ._errors import (
    AccessDeniedError,
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
    ThreadStartError,
    ThrottledError,
    TruncatedFileError,
    UnsupportedStorageError,
    UnsupportedTypeError,
)
from ._export.export import HFExport, export_hf
from ._manager.manager import CheckpointManager, StepCheck, check_step, check_steps
from ._settings import DirectIO, Settings, settings

__version__ = "0.1.0"

# 0.1.0's public helper of the per-call keywords, which ``settings=`` replaced
_DEPRECATED = {
    "current_settings": "ckptstream.current_settings() is deprecated: `with ckptstream.settings() as s:` gives "
                        "the settings in force, and settings=ckptstream.Settings(...) a complete value for one call",
}

if not TYPE_CHECKING:  # type checkers see them gone

    def __getattr__(name: str) -> object:
        if name in _DEPRECATED:
            import warnings

            from . import _settings

            warnings.warn(_DEPRECATED[name], DeprecationWarning, stacklevel=2)
            return getattr(_settings, name)
        raise AttributeError(f"module 'ckptstream' has no attribute {name!r}")

# ``open`` is public (ckptstream.open) but left out of __all__: ``from ckptstream import *`` must not
# shadow the builtin
__all__ = [
    "AsyncMode",
    "AccessDeniedError",
    "BucketNotFoundError",
    "CheckpointManager",
    "CheckpointNotSavedError",
    "CheckpointTimeoutError",
    "CheckpointReader",
    "ChecksumsMissingError",
    "CkptStreamError",
    "ConnectionLostError",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "Device",
    "DirectIO",
    "DirectoryLockedError",
    "ExportError",
    "HFExport",
    "IncompleteCheckpointError",
    "NoCredentialsError",
    "NotACheckpointError",
    "ObjectNotFoundError",
    "ObjectReplacedError",
    "ObjectStoreError",
    "SaveHandle",
    "Settings",
    "SnapshotFallbackWarning",
    "StepCheck",
    "StateMismatchError",
    "StateMismatchWarning",
    "TensorEntry",
    "TensorSlice",
    "ThreadStartError",
    "ThrottledError",
    "TruncatedFileError",
    "UnsupportedStorageError",
    "UnsupportedTypeError",
    "device_to_file",
    "export_hf",
    "file_to_device",
    "host_snapshot_bytes",
    "check_step",
    "check_steps",
    "load",
    "load_into",
    "read_metadata",
    "release_host_snapshot",
    "release_staging",
    "save",
    "save_async",
    "settings",
    "staging_bytes",
    "verify",
    "warm_host_snapshot",
]
