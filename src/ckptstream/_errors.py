"""The package's own exceptions: one base, each subclass also a built-in it refines."""

from __future__ import annotations

import errno


class CkptStreamError(Exception):
    """Base of every error raised by ckptstream itself (OS errors propagate as OSError)."""


class TruncatedFileError(CkptStreamError, EOFError):
    """A file ended before the bytes a read needed."""

    def __init__(self, path: str, offset: int, expected: int, found: int) -> None:
        super().__init__(
            f"{path} is too short: reading {expected} bytes at offset {offset} found only "
            f"{found}; the file is truncated or the offset/size is wrong"
        )
        self.path, self.offset, self.expected, self.found = path, offset, expected, found


class CorruptCheckpointError(CkptStreamError, ValueError):
    """A checkpoint file is malformed or its data does not match its checksums."""


class StateMismatchError(CkptStreamError, ValueError):
    """The state given to load_into does not match the checkpoint (keys, shapes, dtypes)."""


class UnsupportedTypeError(CkptStreamError, TypeError):
    """A state holds a value that cannot be stored (an object, an unsupported dtype), or a file
    holds a dtype that this torch does not have."""


class UnsupportedStorageError(CkptStreamError, ValueError):
    """A URL whose scheme names no storage ckptstream has, or a call that needs what its storage
    cannot do (``mmap=True`` on a target that cannot be mapped)."""


class ObjectStoreError(CkptStreamError, OSError):
    """A request to an object store (``s3://`` URLs) failed; ``url`` names the object, ``code`` is the store's
    error code (None where no answer came)."""

    default_errno = errno.EIO

    def __init__(self, url: str, message: str, code: str | None = None) -> None:
        super().__init__(self.default_errno, message, url)
        self.url, self.code = url, code


class NoCredentialsError(ObjectStoreError, PermissionError):
    """No credentials were found in the standard places."""

    default_errno = errno.EACCES


class AccessDeniedError(ObjectStoreError, PermissionError):
    """The store refused the credentials or their permissions."""

    default_errno = errno.EACCES


class BucketNotFoundError(ObjectStoreError, FileNotFoundError):
    """The bucket of a URL does not exist."""

    default_errno = errno.ENOENT


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """No object has the key of a URL."""

    default_errno = errno.ENOENT


class ThrottledError(ObjectStoreError):
    """The store kept asking to slow down after every retry."""

    default_errno = errno.EAGAIN


class ConnectionLostError(ObjectStoreError, ConnectionError):
    """The endpoint could not be reached, or a connection broke, after every retry."""

    default_errno = errno.ECONNRESET


class StateMismatchWarning(UserWarning):
    """load_into(strict=False) skipped keys; ``missing`` and ``unexpected`` list them."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing, self.unexpected = missing, unexpected
