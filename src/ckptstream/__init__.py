"""ckptstream: stream training state between GPU memory and disk through a few pinned buffers."""

from ._buffers import release_staging, staging_bytes
from ._checkpoint import load, read_metadata, save, verify
from ._errors import (
    CkptStreamError,
    CorruptCheckpointError,
    StateMismatchError,
    StateMismatchWarning,
    TruncatedFileError,
    UnsupportedTypeError,
)
from ._load_into import load_into
from ._settings import Settings, current_settings, settings
from ._transfer import device_to_file, file_to_device

__version__ = "0.1.0"

__all__ = [
    "CkptStreamError",
    "CorruptCheckpointError",
    "Settings",
    "StateMismatchError",
    "StateMismatchWarning",
    "TruncatedFileError",
    "UnsupportedTypeError",
    "current_settings",
    "device_to_file",
    "file_to_device",
    "load",
    "load_into",
    "read_metadata",
    "release_staging",
    "save",
    "settings",
    "staging_bytes",
    "verify",
]
