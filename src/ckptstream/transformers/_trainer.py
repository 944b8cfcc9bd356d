"""StreamCheckpointsMixin: the Hugging Face Trainer's checkpoints written and read by ckptstream.

Why a mixin of the Trainer and not a ``TrainerCallback`` or Accelerate's hooks: a callback's
``on_save`` runs after ``_save_checkpoint`` has written every file with ``torch.save``, and no
callback is asked on resume; the Trainer saves through its own ``torch.save`` calls, not through
``accelerator.save_state``, so Accelerate's hooks never see a Trainer checkpoint. The Trainer's
own seams are its methods: ``_save_checkpoint`` and the loaders ``train`` calls on resume
(``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
``_load_rng_state``). The mixin overrides those, and ``train`` to wait for the background saves
and to pick the folder of ``resume_from_checkpoint=True`` (the Trainer's own pick,
``get_last_checkpoint``, is the newest folder whatever it holds).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from transformers import Trainer
from transformers.trainer_callback import ExportableState

from .._checkpoint.guard import Guard, storage_keys
from .._checkpoint.load import load
from .._checkpoint.save import save
from .._checkpoint.save_async import MODES, SaveHandle, save_async
from .._errors import StateMismatchError, UnsupportedTypeError
from .._storage import storage_for
from ..accelerate import _state
from ..accelerate._stream import _LiveRead, _tensors
from . import _folders
from ._folders import TRAINER_STATE, state_file

__all__ = ["StreamCheckpointsMixin", "StreamTrainer"]

log = logging.getLogger(__name__)

_UNSUPPORTED = ("is_deepspeed_enabled", "is_fsdp_enabled", "is_fsdp_xla_enabled")


class StreamCheckpointsMixin:
    """Make a ``transformers.Trainer`` (or a subclass of it) save and resume its checkpoints
    through ckptstream: ``class MyTrainer(StreamCheckpointsMixin, SFTTrainer): pass``, or
    ``StreamTrainer`` in place of ``Trainer``.

    Each ``checkpoint-<step>`` folder (``save_steps``, ``save_strategy``) then holds
    ``trainer_state.json``, the model's ``config.json`` (and the tokenizer's files), and one
    ckptstream file per process, ``ckptstream_state_<rank>.safetensors``: the main process's
    holds ``model`` (``model.state_dict()``), ``optimizer``, ``scheduler``, ``scaler``, every
    process's ``rng`` (Python's, numpy's, torch's and the device's generators). ``save_total_limit``
    rotates the folders as the Trainer does, once the newer saves are durable.
    ``train(resume_from_checkpoint=True)`` resumes from the newest complete folder, and starts
    over (logging a warning) where the folders hold no state file yet, only what a run killed
    during its first save left.

    Keyword args (besides the Trainer's own):
        checkpoint_mode: "device" (the default), "lazy" or "host" save in the background
            (``ckptstream.save_async`` in that mode); None saves before ``_save_checkpoint`` returns.
        checkpoint_checksum: store a CRC-32C of every tensor (checked on load).
        load_default_checkpoints: resume from a folder of the Trainer's own saver through the
            Trainer's own loader (``torch.load``) instead of raising ``TrainerFolderError``.

    Raises:
        ValueError: a checkpoint_mode it does not take; ``load_best_model_at_end``.
        UnsupportedTypeError: DeepSpeed or FSDP (they write their own sharded checkpoints).
    """

    def __init__(self, *args: Any, checkpoint_mode: str | None = "device", checkpoint_checksum: bool = True,
                 load_default_checkpoints: bool = False, **kwargs: Any) -> None:
        if checkpoint_mode is not None and checkpoint_mode not in MODES:
            raise ValueError(f"checkpoint_mode must be None (synchronous) or one of {list(MODES)}, got "
                             f"{checkpoint_mode!r}")
        super().__init__(*args, **kwargs)
        trainer = self._trainer
        for flag in _UNSUPPORTED:
            if getattr(trainer, flag, False):
                raise UnsupportedTypeError(f"{type(self).__name__}: {flag.removeprefix('is_')[:-len('_enabled')]} "
                                           "writes its own sharded checkpoints; for FSDP2 see ckptstream.dcp")
        if trainer.args.load_best_model_at_end:
            raise ValueError(f"{type(self).__name__}: load_best_model_at_end reads the Trainer's own model files, "
                             "which its checkpoints do not hold: load the best checkpoint's 'model' with "
                             "ckptstream.load (or export it with ckptstream export-hf) after training")
        self.checkpoint_mode, self.checkpoint_checksum = checkpoint_mode, bool(checkpoint_checksum)
        self.load_default_checkpoints = bool(load_default_checkpoints)
        self._pending: SaveHandle | None = None  # the background save in flight (at most one)
        self._pending_run_dir: str | None = None  # whose rotation waits for it
        self._resume_state: tuple[str, dict[str, Any]] | None = None  # (folder, its state) while resuming
        self._guard = Guard()  # "lazy": the next optimizer step waits until the save has read the live tensors

    @property
    def _trainer(self) -> Any:
        return self  # typed Any: the mixin reaches the Trainer's attributes

    # --- train ------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; resuming waits for the background saves first and, for ``True``,
        takes the newest complete checkpoint folder, or starts over with a warning where no folder
        holds a state file yet (a run killed during its first save). ``train`` returns once every
        save it started is durable, and raises a background save's error (a failed save is never lost)."""
        trainer = self._trainer
        self.wait_for_checkpoint()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_folder()
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            if not self._is_default_folder(resume_from_checkpoint):
                _folders.check_folder(resume_from_checkpoint, trainer.args.world_size)
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._resume_state = None
            with contextlib.suppress(Exception):  # the training's own error is the one to raise
                self.wait_for_checkpoint()
            raise
        self._resume_state = None
        self.wait_for_checkpoint()
        return output

    def _newest_folder(self) -> str | bool | None:
        """What ``resume_from_checkpoint=True`` resumes from: the newest complete folder (or with
        ``load_default_checkpoints`` a newer one of the Trainer's own saver); None (a fresh start)
        where the folders hold only what saves killed before publishing left; True where there is
        no folder at all, for the Trainer's own "no valid checkpoint" error."""
        args = self._trainer.args
        folders = _folders.checkpoint_folders(args.output_dir)
        if not folders:
            return True
        found = _folders.folder_to_resume(args.output_dir, args.world_size, take_default=self.load_default_checkpoints)
        if found is None:
            # a background save makes its folder at once and publishes its state file last: a run
            # killed during its first save has no checkpoint, and resuming means starting over
            log.warning("%s: no checkpoint to resume from, the folders there (%s) hold no ckptstream state file, only "
                        "what saves killed before publishing one left: training starts over from step 0",
                        args.output_dir, ", ".join(os.path.basename(f) for f in folders))
        return found

    def wait_for_checkpoint(self) -> None:
        """Wait for the background save in flight, if any (raising its error), then rotate the
        folders as ``save_total_limit`` says."""
        handle, run_dir = self._pending, self._pending_run_dir
        self._pending = self._pending_run_dir = None
        self._guard.close()
        if handle is not None:
            handle.result()
        if run_dir is not None:
            self._rotate(run_dir)

    # --- save -------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer = self._trainer
        self.wait_for_checkpoint()  # the newer folders durable before the rotation removes older ones
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"checkpoint-{trainer.state.global_step}")
        storage = storage_for(folder)
        storage.make_folders(folder)
        target = state_file(folder, trainer.args.process_index)
        # a state file a killed run left for this step goes first: the folder is incomplete until the new one is in
        storage.remove(str(target), missing_ok=True)
        state = self._checkpoint_state()
        if trainer.args.should_save:
            self._save_small_files(folder)
        if self.checkpoint_mode is None:
            save(state, target, checksum=self.checkpoint_checksum)
            self._rotate(run_dir)
        else:
            handle = save_async(state, target, mode=self.checkpoint_mode, checksum=self.checkpoint_checksum)
            self._pending, self._pending_run_dir = handle, run_dir
            if self.checkpoint_mode == "lazy" and not handle.staged():
                self._guard.arm(_LiveRead(handle, storage_keys(_tensors(state))))

    def _checkpoint_state(self) -> dict[str, Any]:
        trainer = self._trainer
        state: dict[str, Any] = {"rng": _state.rng_state(trainer.state.global_step)}
        if not trainer.args.should_save:
            return state
        state["model"] = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        if not trainer.args.save_only_model:
            state["optimizer"] = trainer.optimizer.state_dict()
            state["scheduler"] = trainer.lr_scheduler.state_dict()
            scaler = getattr(trainer.accelerator, "scaler", None)
            state["scaler"] = None if scaler is None else scaler.state_dict()
        return state

    def _save_small_files(self, folder: str) -> None:
        """What the Trainer writes beside the weights, less ``training_args.bin`` (a pickle): the
        model's config (``export-hf --config`` takes it), the tokenizer, ``trainer_state.json``."""
        trainer = self._trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(model, "config") and hasattr(model.config, "save_pretrained"):
            model.config.save_pretrained(folder)
        if trainer.processing_class is not None and hasattr(trainer.processing_class, "save_pretrained"):
            trainer.processing_class.save_pretrained(folder)
        self._update_best(folder)
        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(cb, ExportableState):
                saved = trainer.state.stateful_callbacks[type(cb).__name__]
                if isinstance(saved, list):
                    saved.append(cb.state())
                else:
                    trainer.state.stateful_callbacks[type(cb).__name__] = cb.state()
        trainer.state.save_to_json(os.path.join(folder, TRAINER_STATE))

    def _update_best(self, folder: str) -> None:
        trainer = self._trainer
        if trainer.state.best_global_step:
            best = os.path.join(os.path.dirname(folder), f"checkpoint-{trainer.state.best_global_step}")
            if storage_for(best).kind(best) == "folder":
                trainer.state.best_model_checkpoint = best

    def _rotate(self, run_dir: str) -> None:
        from transformers.trainer_utils import rotate_checkpoints

        trainer = self._trainer
        if trainer.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                               best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=False)

    # --- resume -----------------------------------------------------------------------------------

    def _is_default_folder(self, folder: str) -> bool:
        """A folder of the Trainer's own saver that ``load_default_checkpoints`` lets its loaders read."""
        if not self.load_default_checkpoints:
            return False
        names = _folders.names(folder)
        return state_file(folder, 0).name not in names and any(_folders.TRAINER_FILES.match(n) for n in names)

    def _resumed(self, folder: str, rank: int | None = None) -> dict[str, Any]:
        """The state file of ``folder`` (this process's, or ``rank``'s), read once per resume."""
        trainer = self._trainer
        rank = trainer.args.process_index if rank is None else rank
        cached = self._resume_state
        if rank == trainer.args.process_index and cached is not None and cached[0] == folder:
            return cached[1]
        _folders.check_folder(folder, trainer.args.world_size)
        state: dict[str, Any] = load(state_file(folder, rank), device="cpu", checksum=self.checkpoint_checksum,
                                     mmap=False)
        if rank == trainer.args.process_index:
            self._resume_state = (folder, state)
        return state

    def _shared(self, folder: str) -> dict[str, Any]:
        """The main process's file: the one holding the model, optimizer and scheduler."""
        shared = self._resumed(folder, 0)
        if "model" not in shared:
            raise StateMismatchError(f"{state_file(folder, 0)}: holds no 'model' (a file of a process that does not "
                                     "save the model)")
        return shared

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._is_default_folder(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        trainer = self._trainer
        model = trainer.model if model is None else model
        weights = self._shared(resume_from_checkpoint)["model"]
        _state._check_model(model.state_dict(), weights, f"{state_file(resume_from_checkpoint, 0)}: ['model']",
                            strict=True)
        model.load_state_dict(weights, strict=False)  # as the Trainer: tied names are absent in the model's keys

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._is_default_folder(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        trainer, shared = self._trainer, self._shared(checkpoint)
        if "optimizer" not in shared:
            return  # saved with save_only_model, as the Trainer: nothing to load
        where = f"{state_file(checkpoint, 0)}: ['optimizer']"
        _state._check_optimizer(trainer.optimizer.state_dict(), shared["optimizer"], where)
        trainer.optimizer.load_state_dict(shared["optimizer"])
        trainer.lr_scheduler.load_state_dict(shared["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._is_default_folder(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        scaler, saved = getattr(self._trainer.accelerator, "scaler", None), self._shared(checkpoint).get("scaler")
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)
        # the last loader before the first step: only the generators are still to come
        self._resume_state = (checkpoint, {"rng": self._resumed(checkpoint)["rng"]})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._is_default_folder(checkpoint):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        _state.set_rng_state(self._resumed(checkpoint)["rng"])


class StreamTrainer(StreamCheckpointsMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through ckptstream (``StreamCheckpointsMixin``)."""
