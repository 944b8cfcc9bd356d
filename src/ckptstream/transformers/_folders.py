"""The Trainer's checkpoint folders (``<output_dir>/checkpoint-<global_step>``) as ckptstream
writes them: which one a resume takes, and the refusals of folders it cannot take.

A folder is complete when it holds ``trainer_state.json`` and every process's
``ckptstream_state_<rank>.safetensors``. The state file is published last (atomically, by
``save``/``save_async``), so a folder a killed save left behind has no state file and is passed
over, where the Trainer's own ``get_last_checkpoint`` would take the newest folder whatever it holds.
A run killed during its first save leaves only such folders: none holds a state file, and a resume
starts over.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .._errors import IncompleteCheckpointError, TrainerFolderError
from .._storage import storage_for

__all__ = ["TRAINER_FILES", "TRAINER_STATE", "check_folder", "checkpoint_folders", "folder_to_resume", "names",
           "newest_complete", "state_file"]

TRAINER_STATE = "trainer_state.json"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's PREFIX_CHECKPOINT_DIR and its number
# what the Trainer's own saver writes beside trainer_state.json (transformers' file name constants)
TRAINER_FILES = re.compile(r"^(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin|"
                           r"optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|adapter_model\..*)$")


def state_file(folder: str | os.PathLike[str], rank: int) -> Path:
    """The file process ``rank`` writes into a Trainer checkpoint folder."""
    return Path(folder) / f"ckptstream_state_{rank}.safetensors"


def names(folder: str) -> list[str]:
    """The names in ``folder`` (none where it is not a folder), through its storage."""
    storage = storage_for(folder)
    return sorted(e.name for e in storage.list_folder(folder)) if storage.kind(folder) == "folder" else []


def _missing(folder: str, world_size: int) -> list[str]:
    found = set(names(folder))
    wanted = [TRAINER_STATE, *(state_file(folder, r).name for r in range(world_size))]
    return [name for name in wanted if name not in found]


def check_folder(folder: str, world_size: int) -> None:
    """Raise unless ``folder`` is a complete checkpoint written through ckptstream: a folder of the
    Trainer's own saver raises ``TrainerFolderError`` naming its files, a folder missing a file
    ``IncompleteCheckpointError`` naming it, no such folder ``FileNotFoundError``."""
    if storage_for(folder).kind(folder) != "folder":
        raise FileNotFoundError(f"{folder}: no such checkpoint folder")
    missing = _missing(folder, world_size)
    if not missing:
        return
    theirs = [name for name in names(folder) if TRAINER_FILES.match(name)]
    if theirs and any(name.startswith("ckptstream_state_") for name in missing):
        raise TrainerFolderError(
            f"{folder} was written by the Trainer's own saver ({', '.join(theirs)}), not through ckptstream (no "
            f"{state_file(folder, 0).name}): to continue from it, resume once with "
            "StreamTrainer(..., load_default_checkpoints=True) (the Trainer's own loader reads it; torch.load runs "
            "code from .pt/.pth files: only for folders you trust), and the next checkpoints are written through "
            "ckptstream; or resume with transformers.Trainer", folder, theirs)
    raise IncompleteCheckpointError(
        f"{folder}: the checkpoint is incomplete, {', '.join(missing)} missing (a save that did not finish, or a "
        f"file removed): resume from an earlier checkpoint-<step> folder, or from resume_from_checkpoint=True, "
        "which passes over incomplete folders")


def checkpoint_folders(run_dir: str) -> list[str]:
    """The ``checkpoint-<step>`` folders of ``run_dir``, oldest step first."""
    found = [(int(m.group(1)), name) for name in names(run_dir) if (m := _FOLDER.match(name))]
    return [os.path.join(run_dir, name) for _, name in sorted(found)]


def newest_complete(run_dir: str, world_size: int) -> str | None:
    """The newest complete checkpoint folder of ``run_dir``; None where it holds none. A run whose
    newest folder is of the Trainer's own saver raises ``TrainerFolderError`` (resuming from an
    older ckptstream folder would silently drop steps)."""
    return _newest(checkpoint_folders(run_dir), world_size, take_default=False)


def folder_to_resume(run_dir: str, world_size: int, take_default: bool = False) -> str | None:
    """The folder ``resume_from_checkpoint=True`` resumes from: the newest complete one of
    ``run_dir`` (or with ``take_default`` a newer one of the Trainer's own saver), passing over
    folders a killed save left incomplete. None where no folder holds a state file, only what
    saves killed before publishing one left: the run has no checkpoint yet.

    Raises:
        TrainerFolderError: a folder of the Trainer's own saver newer than any complete one.
        IncompleteCheckpointError: no complete folder, and the newest holding a state file lacks
            a file (a file lost is not a run that never saved).
    """
    folders = checkpoint_folders(run_dir)
    found = _newest(folders, world_size, take_default)
    if found is None:
        holding = [f for f in folders if any(n.startswith("ckptstream_state_") for n in names(f))]
        if holding:
            folder = holding[-1]
            raise IncompleteCheckpointError(
                f"{folder}: the checkpoint is incomplete, {', '.join(_missing(folder, world_size))} missing, and no "
                f"checkpoint-<step> folder of {run_dir} is complete (a file removed, or with several processes a save "
                f"killed after some of them published their files): restore the file, or remove {folder} to start "
                "over")
    return found


def _newest(folders: list[str], world_size: int, take_default: bool) -> str | None:
    for folder in reversed(folders):
        if not _missing(folder, world_size):
            return folder
        found = names(folder)
        if any(TRAINER_FILES.match(name) for name in found):
            if take_default and state_file(folder, 0).name not in found:
                return folder
            check_folder(folder, world_size)  # raises TrainerFolderError
    return None
