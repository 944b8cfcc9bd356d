"""StreamCheckpointIO: Lightning's checkpoint files written and read by ckptstream."""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

from .._checkpoint.load import load, read_metadata
from .._checkpoint.save import save
from .._checkpoint.save_async import MODES, SaveHandle, save_async
from .._checkpoint.snapshot import release_host_snapshot
from .._errors import NotACheckpointError, StorageOptionsError
from .._format import header, sniff
from .._storage import scheme_of, storage_for
from ._staging import StagingGuard
from ._values import TYPES_KEY, decode_table, encode_table, restore, to_plain

__all__ = ["StreamCheckpointIO"]

_STORAGE_OPTIONS = ("metadata",)


class StreamCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` that writes each checkpoint as one ckptstream file.

    ``Trainer(plugins=[StreamCheckpointIO()])`` is the whole switch: ``ModelCheckpoint``,
    ``trainer.save_checkpoint`` and ``fit(ckpt_path=...)`` then go through ckptstream. The files
    are safetensors files with checksums, published atomically; docs/integrations.md says which
    values a checkpoint may hold and what waits where.

    Args:
        mode: None saves before ``save_checkpoint`` returns (``ckptstream.save``). "device",
            "lazy" or "host" save in the background (``ckptstream.save_async`` in that mode);
            the plug-in waits for a save before removing its file, before a load, before another
            save to its path, and at teardown (where the error of a failed save is raised). In
            "lazy" mode the next optimizer update (after its forward and backward pass) and a
            training-mode forward that updates a saved buffer (BatchNorm statistics) first wait
            until the save has copied the state out; in "host" mode the same two wait on the GPU
            for the copies into host memory (``save_async``'s own guard: the host does not wait).
            Call ``wait_staged()`` before changing the saved tensors any other way.
        metadata: ``str -> str`` pairs for every file's header (``ckptstream.read_metadata``).
        checksum: store a CRC-32C of every tensor (checked on load).
        allow_pickle: store values that are not plain data (dataclasses, enums, arbitrary
            objects) with pickle, and unpickle them on load. Loading such a checkpoint runs code
            from the file: only for checkpoints you trust. Off: such values are refused, naming
            their key path.
        max_in_flight: at most this many background saves at once in the process (the next
            save waits for the oldest).
        load_device: where loaded tensors land (Lightning moves them where they belong).

    Raises:
        ValueError: a mode, metadata or max_in_flight it does not take.
    """

    def __init__(self, mode: str | None = None, *, metadata: Mapping[str, str] | None = None, checksum: bool = True,
                 allow_pickle: bool = False, max_in_flight: int = 1, load_device: str | torch.device = "cpu") -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"StreamCheckpointIO: mode must be None (synchronous) or one of {list(MODES)}, "
                             f"got {mode!r}")
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"StreamCheckpointIO: max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        self.mode, self.checksum, self.allow_pickle = mode, bool(checksum), bool(allow_pickle)
        self.max_in_flight, self.load_device = max_in_flight, torch.device(load_device)
        self.metadata = _checked_metadata(metadata, "StreamCheckpointIO(metadata=...)")
        self._lock = threading.Lock()
        self._saves: dict[str, SaveHandle] = {}  # background saves by their target (_target)
        self._guard = StagingGuard()

    def __getstate__(self) -> dict[str, Any]:
        """The options only (Lightning pickles its strategy for spawned processes): a copy owns
        none of this plug-in's saves, which this one still waits for."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_saves", "_guard")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._saves, self._guard = threading.Lock(), {}, StagingGuard()

    # --- CheckpointIO -----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path`` (now, or in the background by ``mode``).

        Raises:
            UnsupportedTypeError: a value this plug-in does not store, named by its key path
                (nothing is written).
            StorageOptionsError: ``storage_options`` other than None or ``{"metadata": {str: str}}``.
            UnsupportedStorageError: a URL of a scheme no storage serves (naming the URL and
                what to install).
            CheckpointNotSavedError, or the save's own error: an earlier background save failed.
        """
        target = _target(path)
        metadata = {**self.metadata, **_storage_metadata(storage_options)}
        plain, table = to_plain(checkpoint, allow_pickle=self.allow_pickle)
        if table:
            metadata[TYPES_KEY] = encode_table(table)
        self._wait(target)  # a save of the same path first: its error, and the order of the two files
        self._prune()
        storage_for(target).make_folders(_parent(target))
        if self.mode is None:
            save(plain, target, metadata=metadata, checksum=self.checksum)
            return
        handle = save_async(plain, target, mode=self.mode, metadata=metadata, checksum=self.checksum,
                            max_in_flight=self.max_in_flight)
        with self._lock:
            self._saves[target] = handle
        if self.mode == "lazy" and not handle.staged():
            self._guard.arm(handle, _tensors(plain))

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved by this plug-in, once every background save has ended.

        Args:
            path: the file.
            map_location: None (``load_device``), or a device (str or ``torch.device``).
            weights_only: True refuses a checkpoint that holds pickled values (see ``allow_pickle``).

        Raises:
            FileNotFoundError: no file at ``path``.
            NotACheckpointError: a file of another format (a ``torch.save`` file is named as one).
            CorruptCheckpointError: not a ckptstream file, or damaged (a checksum, a truncated file).
            UnsupportedTypeError: the file holds pickled values and ``allow_pickle`` is off (or
                ``weights_only`` is True).
            StorageOptionsError: a ``map_location`` that is not a device.
        """
        device = self._device(map_location)
        self.wait()
        target = _target(path)
        if storage_for(target).kind(target) != "file":  # the target of any link: a file, or none
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        try:
            metadata = read_metadata(target)
        except NotACheckpointError as e:
            if e.kind != sniff.TORCH_SAVE:
                raise
            raise NotACheckpointError(
                f"{target} is a torch.save file (Lightning's default checkpoint format), not a ckptstream file: load "
                "it without StreamCheckpointIO, or convert it once: StreamCheckpointIO().save_checkpoint(torch.load("
                "path, weights_only=False), new_path) (torch.load runs code from the file: only for files you trust)",
                target, e.kind) from e
        state = load(target, device=device, checksum=self.checksum)
        if TYPES_KEY not in metadata:
            return state  # type: ignore[no-any-return]
        why_not = None
        if not self.allow_pickle:
            why_not = ("loading them runs code from the file; if you trust it, load it with "
                       "StreamCheckpointIO(allow_pickle=True)")
        elif weights_only:
            why_not = "weights_only=True loads plain data only"
        return restore(state, decode_table(metadata[TYPES_KEY], target), where=target,  # type: ignore[no-any-return]
                       unpickle=why_not)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` (a file, or a folder and everything in it), after
        the background saves to it have ended (a file still being written is never removed; its
        save's error, if it failed, is raised)."""
        target = _target(path)
        self._wait(target, inside=True)  # a folder's removal: the saves into it first
        given = _given(path)
        storage = storage_for(given)
        kind = storage.kind(given)
        if kind == "folder":
            storage.remove_tree(given)
        elif kind is not None:  # a file, or a link (removed itself)
            storage.remove(given, missing_ok=True)

    def teardown(self) -> None:
        """Wait for every background save; raises the first error of those that failed. In
        "host" mode, then frees the snapshot memory kept for the next save
        (``ckptstream.release_host_snapshot``): the host gets the state's size back."""
        try:
            self._guard.close()
        finally:
            try:
                self.wait()
            finally:
                if self.mode == "host":
                    release_host_snapshot()

    # --- waiting ----------------------------------------------------------------------------------

    def wait_staged(self) -> None:
        """Make the state safe to change from here on: wait until every "lazy" save has copied
        it out, and order the current streams after the copies of every "host" save (the host
        does not wait for those)."""
        self._guard.wait()
        with self._lock:
            handles = list(self._saves.values())
        for handle in handles:
            if handle.mode == "host":
                handle.wait_staged()

    def wait(self) -> None:
        """Wait for every background save of this plug-in to end; raises the first error of those
        that failed (after waiting for all of them)."""
        with self._lock:
            handles = list(self._saves.values())
        first: BaseException | None = None
        for handle in handles:
            try:
                self._collect(handle)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _prune(self) -> None:
        """Forget the saves that ended well (a failed one is kept: its error is raised where it
        is waited for, at the latest at teardown)."""
        with self._lock:
            for path, handle in list(self._saves.items()):
                if handle.done() and handle._error is None:
                    del self._saves[path]

    def _wait(self, target: str, *, inside: bool = False) -> None:
        """Wait for the save of ``target``; with ``inside``, also for those of the files in the
        folder ``target`` (a removal of the folder)."""
        under = target.rstrip("/" + os.sep) + ("/" if scheme_of(target) is not None else os.sep)
        with self._lock:
            handles = [h for t, h in self._saves.items() if t == target or (inside and t.startswith(under))]
        for handle in handles:
            self._collect(handle)

    def _collect(self, handle: SaveHandle) -> None:
        try:
            handle.result()
        finally:
            with self._lock:
                for target in [t for t, h in self._saves.items() if h is handle]:
                    del self._saves[target]

    def _device(self, map_location: Any) -> torch.device:
        if map_location is None:
            return self.load_device
        if isinstance(map_location, (str, torch.device)):
            try:
                return torch.device(map_location)
            except RuntimeError as e:
                raise StorageOptionsError(f"StreamCheckpointIO.load_checkpoint: map_location {map_location!r} is "
                                          "not a device") from e
        raise StorageOptionsError(f"StreamCheckpointIO.load_checkpoint: map_location must be None or a device "
                                  f"(str or torch.device), got {type(map_location).__name__}: tensors are loaded "
                                  "straight to one device")


def _target(path: str | os.PathLike[str]) -> str:
    """Where the file is published: a local path's absolute real path (a symbolic link's
    target), a URL as given."""
    given = _given(path)
    return given if scheme_of(given) is not None else os.path.realpath(given)


def _given(path: str | os.PathLike[str]) -> str:
    """A local path made absolute as given (a symbolic link itself; ``file://`` dropped), or a
    URL of a storage ckptstream has (``s3://...``, a registered scheme): Lightning passes URLs
    on as they are, as its own IO hands them to fsspec. A URL of any other scheme raises
    UnsupportedStorageError (``storage_for``), naming it and what to install."""
    text = os.fsdecode(path)
    if scheme_of(text) == "file":
        text = text.split("://", 1)[1]
    if scheme_of(text) is not None:
        storage_for(text)  # no storage serves the scheme: the typed error, before any work
        return text
    return os.path.abspath(text)


def _parent(target: str) -> str:
    """The folder a file is published in (URLs are joined with "/", whatever the OS)."""
    if scheme_of(target) is not None:
        return posixpath.dirname(target)
    return os.path.dirname(target) or "."


def _checked_metadata(metadata: Any, where: str) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: metadata must be a mapping of str to str, got {type(metadata).__name__}")
    checked = dict(header.check_user_metadata(metadata))
    if TYPES_KEY in checked:
        raise ValueError(f"{where}: the metadata key {TYPES_KEY!r} is reserved (it records the value types of a "
                         "Lightning checkpoint): use another key")
    return checked


def _storage_metadata(storage_options: Any) -> dict[str, str]:
    if storage_options is None:
        return {}
    where = "StreamCheckpointIO.save_checkpoint(storage_options=...)"
    if not isinstance(storage_options, Mapping):
        raise StorageOptionsError(f"{where}: expected None or a dict such as {{'metadata': {{'run': 'a'}}}}, got "
                                  f"{type(storage_options).__name__}")
    unknown = sorted(map(str, set(storage_options) - set(_STORAGE_OPTIONS)))
    if unknown:
        raise StorageOptionsError(f"{where}: unknown keys {unknown}; it takes {list(_STORAGE_OPTIONS)} (str -> str "
                                  "pairs for the file's header)")
    try:
        return _checked_metadata(storage_options.get("metadata"), where)
    except (TypeError, ValueError) as e:
        raise StorageOptionsError(str(e)) from e


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a plain state (what a lazy save may read)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []
