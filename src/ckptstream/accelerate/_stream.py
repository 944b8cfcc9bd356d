"""StreamState: an Accelerator's ``save_state`` / ``load_state`` written and read by ckptstream.

Why a wrapper and not Accelerate's hooks alone: ``register_save_state_pre_hook`` hands over the
model weights only. The optimizers, schedulers, samplers, GradScaler, RNG states and registered
objects are written after the hook by ``save_accelerator_state`` and ``save_custom_state`` with
``torch.save``, and no hook lets a caller take them over (nor return before they are written, as
a background save must); ``register_load_state_pre_hook`` is the same on load. So the two
methods of the one accelerator are replaced (on the instance: other accelerators, and the class,
are untouched), and the registered pre-hooks still run where Accelerate runs them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch

from .._checkpoint.guard import Guard, StorageKey, storage_keys
from .._checkpoint.load import load
from .._checkpoint.save import save
from .._checkpoint.save_async import MODES, SaveHandle, save_async
from .._errors import AccelerateFolderError, IncompleteCheckpointError, UnsupportedTypeError
from .._storage import Storage, storage_for
from . import _fsdp, _state

__all__ = ["ACCELERATE_FILES", "AccelerateFolderError", "StreamState", "state_file"]

log = logging.getLogger(__name__)

# what Accelerate's own saver writes (accelerate.utils.constants), to name a folder of its format
ACCELERATE_FILES = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|(optimizer|scheduler|sampler|"
                              r"dl_state_dict)(_\d+)?\.bin|scaler\.pt|random_states_\d+\.pkl|"
                              r"custom_checkpoint_\d+\.pkl)$")
_UNSUPPORTED = {"FSDP": "only FSDP2 with state_dict_type SHARDED_STATE_DICT goes through ckptstream (its model and "
                        "optimizer through ckptstream.dcp); FSDP1 and full state dicts are written by Accelerate",
                "DEEPSPEED": "DeepSpeed writes its engine's checkpoint itself",
                "MEGATRON_LM": "Megatron-LM writes its model's checkpoint itself",
                "XLA": "XLA tensors are not streamed by ckptstream"}


def state_file(folder: str | os.PathLike[str], rank: int) -> Path:
    """The file process ``rank`` writes into a checkpoint folder."""
    return Path(folder) / f"ckptstream_state_{rank}.safetensors"


class _LiveRead:
    """A "lazy" save still reading the live tensors: the guard waits for it where they change."""

    def __init__(self, handle: SaveHandle, storages: frozenset[StorageKey]) -> None:
        self.handle, self.storages = handle, storages

    def order(self) -> None:
        self.handle.wait_staged()

    def done(self) -> bool:
        return self.handle.staged()


class StreamState:
    """Make ``accelerator.save_state`` / ``load_state`` go through ckptstream.

    ``StreamState(accelerator)`` replaces the two methods of that accelerator: each process then
    writes one ckptstream file per checkpoint folder (``ckptstream_state_<rank>.safetensors``),
    the main process's holding the models, optimizers, schedulers, sampler and dataloader states,
    GradScaler and registered objects, every process's its RNG states and step: what Accelerate
    itself saves, in its folders (``ProjectConfiguration(automatic_checkpoint_naming=True,
    total_limit=...)`` included). ``close()`` (or the end of a ``with`` block) waits for the
    background saves and gives the accelerator its own methods back.

    Under FSDP2 (``fsdp_version=2``, ``SHARDED_STATE_DICT``) Accelerate's own ``save_state`` /
    ``load_state`` run instead, their DCP model and optimizer folders written and read by
    ``ckptstream.dcp`` (``_fsdp``); the other parts stay Accelerate's files.

    Args:
        accelerator: an ``accelerate.Accelerator`` (single process, DDP, multi-CPU or FSDP2).
        mode: None saves before ``save_state`` returns (``ckptstream.save``); "device", "lazy" or
            "host" save in the background (``ckptstream.save_async`` in that mode): the file
            holds the state of the call. "lazy" waits before the next optimizer update (and a
            training-mode forward of a module with saved buffers) until the state is copied out.
        checksum: store a CRC-32C of every tensor (checked on load).
        max_in_flight: at most this many background saves at once in the process.
        load_device: where loaded tensors land before ``load_state_dict`` copies them in.

    Raises:
        UnsupportedTypeError: an FSDP1 (or FSDP2 full state dict), DeepSpeed, Megatron-LM or
            XLA accelerator: they write their own state.
        ValueError: a mode or max_in_flight it does not take (under FSDP2, any mode but None).
    """

    def __init__(self, accelerator: Any, mode: str | None = None, *, checksum: bool = True, max_in_flight: int = 1,
                 load_device: str | torch.device = "cpu") -> None:
        kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        fsdp = kind == "FSDP" and _fsdp.routes_through_dcp(accelerator)
        if kind in _UNSUPPORTED and not fsdp:
            raise UnsupportedTypeError(f"StreamState: the accelerator runs {kind}: {_UNSUPPORTED[kind]}")
        if fsdp and mode is not None:
            raise ValueError(f"StreamState: under FSDP2 Accelerate saves with dcp.save before save_state returns: mode "
                             f"must be None, got {mode!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"StreamState: mode must be None (synchronous) or one of {list(MODES)}, got {mode!r}")
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"StreamState: max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        self.accelerator, self.mode, self.checksum = accelerator, mode, bool(checksum)
        self.max_in_flight, self.load_device = max_in_flight, torch.device(load_device)
        self._lock = threading.Lock()
        self._saves: dict[str, SaveHandle] = {}  # background saves by the folder they write into
        self._guard = Guard()
        self._methods = {"save_state": self._fsdp_save_state, "load_state": self._fsdp_load_state} if fsdp else {
            "save_state": self.save_state, "load_state": self.load_state}
        for name, method in self._methods.items():
            setattr(accelerator, name, method)

    def __enter__(self) -> StreamState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every background save (raising the first error) and give the accelerator
        back its own ``save_state`` / ``load_state``. Safe to call twice."""
        try:
            self._guard.close()
            self.wait()
        finally:
            for name, method in self._methods.items():
                if getattr(self.accelerator, name, None) == method:
                    delattr(self.accelerator, name)

    # --- FSDP2: Accelerate's own methods, its DCP storage made ckptstream's (_fsdp) -------------------

    def _fsdp_save_state(self, *args: Any, **kwargs: Any) -> Any:
        with _fsdp.through_dcp(self.checksum):
            return type(self.accelerator).save_state(self.accelerator, *args, **kwargs)

    def _fsdp_load_state(self, *args: Any, **kwargs: Any) -> Any:
        with _fsdp.through_dcp(self.checksum):
            return type(self.accelerator).load_state(self.accelerator, *args, **kwargs)

    # --- save ---------------------------------------------------------------------------------------

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Path:
        """``Accelerator.save_state``, through ckptstream: returns the folder, as Accelerate does.

        The folder is chosen as Accelerate chooses it: ``output_dir``, or with automatic naming
        ``<project_dir>/checkpoints/checkpoint_<iteration>`` after removing the oldest folders
        beyond ``total_limit`` (a background save still writing into one is waited for first).
        ``safe_serialization`` is accepted and ignored: the files are always safetensors files.

        Raises:
            ValueError: with automatic naming, the folder of this iteration exists (as Accelerate).
            UnsupportedTypeError: a value ckptstream does not store (in a registered object's
                ``state_dict``), named by its key path, before any file is written.
        """
        acc = self.accelerator
        if save_model_func_kwargs:
            raise TypeError(f"StreamState.save_state: keyword arguments {sorted(save_model_func_kwargs)} are for "
                            "DeepSpeed's save_checkpoint, which StreamState does not run")
        folder = self._folder(output_dir)
        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, str(folder))
        state: dict[str, Any] = {"rng": _state.rng_state(acc.step)}
        if self._writes_shared():
            state.update(_state.shared_state(acc, weights))
        target = state_file(folder, acc.process_index)
        self._wait_for(str(folder))  # an earlier save into the same folder publishes first
        if self.mode is None:
            save(state, target, checksum=self.checksum)
        else:
            handle = save_async(state, target, mode=self.mode, checksum=self.checksum,
                                max_in_flight=self.max_in_flight)
            with self._lock:
                self._saves[str(folder)] = handle
            if self.mode == "lazy" and not handle.staged():
                self._guard.arm(_LiveRead(handle, storage_keys(_tensors(state))))
        acc.project_configuration.iteration += 1
        return folder

    def _writes_shared(self) -> bool:
        acc = self.accelerator
        on_each_node = acc.project_configuration.save_on_each_node
        return bool(acc.is_local_main_process if on_each_node else acc.is_main_process)

    def _folder(self, output_dir: str | os.PathLike[str] | None) -> Path:
        """Accelerate's choice of folder (``Accelerator.save_state``), and its ``total_limit``."""
        acc, config = self.accelerator, self.accelerator.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError("StreamState.save_state: output_dir is None and automatic checkpoint naming is off")
            _store(output_dir).make_folders(os.fspath(output_dir))
            return Path(output_dir)
        parent = os.path.join(acc.project_dir, "checkpoints")
        store = _store(parent)
        store.make_folders(parent)
        folder = os.path.join(parent, f"checkpoint_{acc.save_iteration}")
        # before any removal (a refused save removes nothing); a killed save's empty folder is reused
        if store.exists(folder) and _holds_checkpoint_files(folder):
            raise ValueError(f"Checkpoint directory {folder} ({acc.save_iteration}) already exists: set "
                             "accelerator.project_configuration.iteration to the iteration to go on from")
        if config.total_limit is not None:
            # every process's earlier saves published first: each folder then either is a checkpoint
            # or what a killed save left, and a kill after the removal still finds one to resume from
            self.wait()
            acc.wait_for_everyone()
            if acc.is_main_process:
                self._remove_beyond_limit(parent, folder, config.total_limit)
        acc.wait_for_everyone()
        store.make_folders(folder)
        return Path(folder)

    def _remove_beyond_limit(self, parent: str, folder: str, total_limit: int) -> None:
        """``total_limit`` as Accelerate applies it, counting checkpoints only: a folder without
        every process's file (a killed save's) is removed and not counted, else a run killed twice
        in a row would remove its last checkpoint for the leftovers. The newest checkpoint stays
        until the new one is written, whatever the limit (with ``total_limit=1`` two folders are
        there from one ``save_state`` until the next)."""
        store, processes = _store(parent), self.accelerator.num_processes
        folders = sorted((os.path.join(parent, e.name) for e in store.list_folder(parent)
                          if e.kind == "folder" and os.path.join(parent, e.name) != folder), key=_number)
        checkpoints = [f for f in folders if _complete(f, processes) or _holds_accelerate_files(f)]
        keep = max(total_limit - 1, 1)
        for old in [f for f in folders if f not in checkpoints] + checkpoints[:-keep]:
            store.remove_tree(old)

    # --- load ---------------------------------------------------------------------------------------

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """``Accelerator.load_state``, through ckptstream, once every background save has ended.

        ``input_dir`` None with automatic naming loads the newest folder that holds every
        process's file (a folder a killed save left without its file is passed over). Where no
        folder there holds a checkpoint file, only what saves killed before publishing one left
        (a background save makes its folder at once, its file later), nothing is loaded and a
        warning is logged: a run killed during its first save starts over.
        ``load_model_func_kwargs`` go to each model's ``load_state_dict`` (``strict=False``).
        Everything is read and checked against the accelerator before any object is changed.

        Raises:
            AccelerateFolderError: the folder holds Accelerate's own files, not ckptstream's.
            FileNotFoundError: no such folder, no checkpoint file in it, or (automatic naming)
                no checkpoint folder; a folder holding some process's file but not every one's.
            StateMismatchError: the checkpoint does not fit the accelerator (another number of
                models or registered objects, a model key or shape, an optimizer's param group),
                naming the part and key; nothing is loaded.
            CorruptCheckpointError: a damaged file (a checksum, a truncated file).
        """
        acc = self.accelerator
        self.wait()
        folder = self._input_folder(input_dir)
        if folder is None:
            return
        models = list(acc._models)
        for hook in acc._load_model_state_pre_hook.values():
            hook(models, str(folder))
        own = self._read(folder, acc.process_index)
        shared_rank = acc.process_index - acc.local_process_index if acc.project_configuration.save_on_each_node else 0
        shared = own if shared_rank == acc.process_index else self._read(folder, shared_rank)
        if not all(part in shared for part in _state.SHARED):
            raise IncompleteCheckpointError(f"{state_file(folder, shared_rank)} holds no model or optimizer state "
                                            "(a file of a process that did not write them)")
        strict = bool(load_model_func_kwargs.get("strict", True))
        _state.check(acc, models, shared, strict, str(folder))
        _state.apply(acc, models, shared, load_model_func_kwargs)
        acc.step = own["rng"]["step"]
        _state.set_rng_state(own["rng"])

    def _read(self, folder: Path, rank: int) -> Any:
        path = state_file(folder, rank)
        if not path.is_file():
            _refuse_folder(folder, path)
        return load(path, device=self.load_device, checksum=self.checksum, mmap=False)

    def _input_folder(self, input_dir: str | os.PathLike[str] | None) -> Path | None:
        """The folder to load; None where the checkpoint folders are only what killed saves left."""
        acc = self.accelerator
        if input_dir is not None:
            folder = Path(os.path.expanduser(os.fspath(input_dir)))
            if _store(folder).kind(str(folder)) != "folder":
                raise FileNotFoundError(f"Tried to find {folder} but folder does not exist")
            return folder
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        parent = os.path.join(acc.project_dir, "checkpoints")
        folders = sorted((os.path.join(parent, f) for f in _names(parent)), key=_number) if _store(parent).kind(
            parent) == "folder" else []
        for candidate in reversed(folders):
            if _complete(candidate, acc.num_processes):
                return Path(candidate)
        # a folder with some process's file but not every one's may be a file lost, not a save
        # killed: refused, never taken for a run that has not saved yet
        holding = [f for f in folders if _holds_checkpoint_files(f)]
        if holding:
            newest = holding[-1]
            missing = next(state_file(newest, r) for r in range(acc.num_processes)
                           if _store(newest).kind(str(state_file(newest, r))) != "file")
            _refuse_folder(Path(newest), missing)
        if not folders:
            raise FileNotFoundError(f"{parent}: no checkpoint folder to load")
        log.warning("%s: no checkpoint to load, the folders there (%s) hold no checkpoint file, only what saves "
                    "killed before publishing one left: the accelerator's state is left as it is", parent,
                    ", ".join(os.path.basename(f) for f in folders))
        return None

    # --- waiting ------------------------------------------------------------------------------------

    def wait_staged(self) -> None:
        """Make the state safe to change from here on (as ``SaveHandle.wait_staged``, for every
        background save): a change the guard's hooks do not see comes after this."""
        self._guard.order()
        with self._lock:
            handles = list(self._saves.values())
        for handle in handles:
            handle.wait_staged()

    def wait(self) -> None:
        """Wait for every background save to end; raises the first error of those that failed."""
        with self._lock:
            folders = list(self._saves)
        first: BaseException | None = None
        for folder in folders:
            try:
                self._wait_for(folder)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _wait_for(self, folder: str) -> None:
        with self._lock:
            handle = self._saves.pop(folder, None)
        if handle is not None:
            handle.result()


def _number(folder: str) -> int:
    """Accelerate's order of checkpoint folders: the last number in the name."""
    found = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)
    return int(found[0]) if found else -1


def _store(path: str | os.PathLike[str]) -> Storage:
    return storage_for(os.fspath(path))


def _names(folder: str) -> list[str]:
    """The names in ``folder``, through its storage."""
    return [e.name for e in _store(folder).list_folder(folder)]


def _holds_checkpoint_files(folder: str) -> bool:
    return any(f.startswith("ckptstream_state_") or ACCELERATE_FILES.match(f) for f in _names(folder))


def _holds_accelerate_files(folder: str) -> bool:
    """A folder of Accelerate's own saver: a checkpoint to count (as Accelerate counts it)."""
    return any(ACCELERATE_FILES.match(f) for f in _names(folder))


def _complete(folder: str, processes: int) -> bool:
    """Every process's file is in ``folder`` (each is published whole, or not at all)."""
    return all(_store(folder).kind(str(state_file(folder, r))) == "file" for r in range(processes))


def _refuse_folder(folder: Path, missing: Path) -> None:
    theirs = sorted(f for f in _names(str(folder)) if ACCELERATE_FILES.match(f)) if _store(folder).kind(
        str(folder)) == "folder" else []
    if theirs:
        raise AccelerateFolderError(
            f"{folder} was written by Accelerate's own save_state ({', '.join(theirs)}), not through ckptstream (no "
            f"{missing.name}): load it once with the accelerator's own load_state (StreamState(...).close() gives it "
            "back, or load before creating the StreamState), then save_state through ckptstream; torch.load runs code "
            "from those .bin/.pkl files: only for folders you trust", str(folder), theirs)
    raise FileNotFoundError(f"{folder}: no ckptstream checkpoint here ({missing.name} is missing): a save that did not "
                            "finish, or not a checkpoint folder")


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []
