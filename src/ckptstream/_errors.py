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


class NotACheckpointError(CorruptCheckpointError):
    """A file of another format where a checkpoint file was expected (a torch.save file, a DCP
    ``.metadata``, a pickle, a gzip or zip archive): ``kind`` names the format ("torch.save",
    "DCP metadata", "pickle", "gzip", "zip"), the message the file and what to do."""

    def __init__(self, message: str, path: str, kind: str) -> None:
        super().__init__(message)
        self.path, self.kind = path, kind


class ChecksumsMissingError(CorruptCheckpointError):
    """Checksums were required (``require_checksums=True``; a step of a CheckpointManager, a
    rank file of ``ckptstream.dcp`` whose metadata records them) but the file holds none: it was
    written without them, or its header was rewritten without ckptstream's ``__metadata__``."""


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


class ObjectReplacedError(ObjectStoreError):
    """An object was replaced while it was read: a later read found another ETag or size than its
    opening. A load (``load``, ``load_into``, ``verify``) then reads it again once from a new
    opening, and raises this when that races a replace too."""


class DeadlineExceededError(ConnectionLostError, TimeoutError):
    """A request to an object store did not end within its deadline (``deadline``, seconds:
    the settings ``s3_timeout`` plus its bytes at ``s3_min_rate``), retries included;
    ``operation`` says which."""

    default_errno = errno.ETIMEDOUT

    def __init__(self, url: str, message: str, operation: str, deadline: float) -> None:
        super().__init__(url, message)
        self.operation, self.deadline = operation, deadline


class StateMismatchWarning(UserWarning):
    """load_into(strict=False) skipped keys; ``missing`` and ``unexpected`` list them."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing, self.unexpected = missing, unexpected


class ThreadStartError(CkptStreamError, RuntimeError):
    """The process could not start a thread that a transfer needs: it reached a limit on threads
    (the user's process limit, a container's pids limit) or on the memory of their stacks."""


class CheckpointNotSavedError(CkptStreamError, RuntimeError):
    """An earlier background save of this process failed and its error was not collected (by
    ``result()`` or ``wait()``): the next ``save_async`` raises it instead of starting."""


class SnapshotFallbackWarning(UserWarning):
    """``save_async(mode="device")`` found too little free GPU memory for its snapshot: it
    streamed from the live tensors and returned once they were copied out (a stall)."""


class DirectoryLockedError(CkptStreamError, RuntimeError):
    """Another CheckpointManager writes this directory as the same rank (``holder`` says which
    process: host and pid); read-only use (``latest_step``, ``steps``, ``load``, ``path``)
    needs no lock."""

    def __init__(self, message: str, directory: str, rank: int, holder: dict[str, object]) -> None:
        super().__init__(message)
        self.directory, self.rank, self.holder = directory, rank, holder


class IncompleteCheckpointError(CkptStreamError, RuntimeError):
    """A step of a CheckpointManager did not complete: another rank's save failed, or the ranks
    disagree on the step (each rank's own failure is raised as itself)."""


class CheckpointTimeoutError(IncompleteCheckpointError, TimeoutError):
    """A step of a CheckpointManager did not complete within its ``timeout``: a rank never
    reported it (not running, or not saving the same steps)."""


class ExportError(CkptStreamError, ValueError):
    """A source cannot be exported as asked: nothing under the prefix, an unknown dtype or size,
    ranks that disagree, chunks that cannot be read without running code. The message names the
    source and says what to do."""


class StorageOptionsError(CkptStreamError, TypeError):
    """``storage_options`` (``Trainer.save_checkpoint(..., storage_options=...)``) or a
    ``map_location`` that StreamCheckpointIO does not take."""


class UnsupportedPathError(CkptStreamError, ValueError):
    """Raised by nothing now: StreamCheckpointIO takes the URLs of every storage ckptstream has
    (a URL of any other scheme raises ``UnsupportedStorageError``). Kept so that code that
    catches it still imports."""


class BenchError(CkptStreamError, RuntimeError):
    """The benchmark cannot run as asked (disk space, memory, devices); the message says why."""


class AccelerateFolderError(NotACheckpointError):
    """A folder written by Accelerate's own saver (``files`` names what is there), given to a
    ``StreamState``'s ``load_state``."""

    def __init__(self, message: str, path: str, files: list[str]) -> None:
        super().__init__(message, path, "accelerate")
        self.files = files


class TrainerFolderError(NotACheckpointError):
    """A checkpoint folder written by the Hugging Face Trainer's own saver (``files`` names what
    is there), given to a Trainer that reads its checkpoints through ckptstream."""

    def __init__(self, message: str, path: str, files: list[str]) -> None:
        super().__init__(message, path, "transformers.Trainer")
        self.files = files
