"""The directory of a CheckpointManager: one folder per step, one file per rank, a DONE marker.

    DIR/step-000000001200/state.safetensors                (one process)
    DIR/step-000000001200/rank-00003-of-00008.safetensors  (several: one file per rank)
    DIR/step-000000001200/DONE                             JSON, published last, atomically
    DIR/step-000000001200/FAILED-rank-00003                a rank's save failed (no process group)
    DIR/step-000000001200/READY-rank-00003                 a rank is ready for the step (no process group)
    DIR/.lock-rank-00003                                   held by the rank's writing manager (``lock``)

Only ``step-`` and exactly 12 ASCII digits name a step. A step is complete when its DONE marker
is a small regular file of the format below naming exactly the rank files of the step, which all
exist as regular files with the sizes it records: DONE is published (``write_small``: on local
files temp, fsync, rename, folder fsync) only once every rank's file is durable, and removed
first (and that removal made durable) when a step is deleted. Anything else is an incomplete
step, whatever it holds: ignored by the listing, removed later. The manager removes only the
files it writes (the names above, and what unfinished writes of them left: ``Storage.unfinished``,
``remove_temps``): a folder holding anything else stays, with that inside.

Every access goes through the storage of the directory (``storage_for``), so a manager works on
any storage: local paths, or URLs of a registered one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from .._storage import Entry, Kind, Storage, storage_for

DONE = "DONE"
FORMAT = "ckptstream-manager 1"
SINGLE = "state.safetensors"
LARGEST_STEP = 10**12 - 1  # the folder names hold exactly 12 digits
# DONE holds about 50 bytes per rank; larger ones are refused unread, so that a planted file
# costs a listing nothing: 4 KiB, plus 4 KiB per rank file in its folder
DONE_BYTES = 4096
# DONE's own format nests two objects; a bound on every bracket in it bounds its nesting (and
# json's recursion) before it is parsed
DONE_BRACKETS = 16
MARKER_BYTES = 4096  # a FAILED marker's text, read for messages
NOT_A_FILE = "not a regular file (a symbolic link, a FIFO, a socket or a device)"
_STEP_DIR = re.compile(r"step-([0-9]{12})")
_RANK_FILE = re.compile(r"rank-([0-9]{5,})-of-([0-9]{5,})\.safetensors")
_MARKER = re.compile(r"(?:FAILED|READY)-rank-([0-9]{5,})")


def step_dir(directory: str, step: int) -> str:
    return storage_for(directory).join(directory, f"step-{step:012d}")


def step_of(name: str) -> int | None:
    """The step a folder's name gives, None for a name that the manager does not write."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def file_name(rank: int, world_size: int) -> str:
    return SINGLE if world_size == 1 else f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def failed_name(rank: int) -> str:
    return f"FAILED-rank-{rank:05d}"


def ready_name(rank: int) -> str:
    return f"READY-rank-{rank:05d}"


def is_manager_file(name: str) -> bool:
    """Whether a step folder's entry is one the manager or its ranks write."""
    if name in (DONE, SINGLE):
        return True
    m = _RANK_FILE.fullmatch(name)
    if m:
        rank, world = int(m.group(1)), int(m.group(2))
        return rank < world and file_name(rank, world) == name
    m = _MARKER.fullmatch(name)
    return m is not None and name in (failed_name(int(m.group(1))), ready_name(int(m.group(1))))


def step_dirs(directory: str) -> dict[int, str]:
    """Every step folder in ``directory`` (complete or not), by step: real folders only, named
    as the manager names them."""
    storage = storage_for(directory)
    try:
        entries = storage.list_folder(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {step: storage.join(directory, e.name) for e in entries
             if e.kind == "folder" and (step := step_of(e.name)) is not None}
    return dict(sorted(found.items()))


def listing(folder: str) -> dict[str, Entry]:
    """The entries of ``folder`` by name; none where it cannot be listed."""
    try:
        return {e.name: e for e in storage_for(folder).list_folder(folder)}
    except OSError:
        return {}


# --- is a step complete, and why not ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """A step folder as the manager counts it (see ``check_step``).

    Attributes:
        folder: the folder's path.
        step: the step its name gives; None where the name is not one the manager writes
            (``step-`` and 12 ASCII digits): the manager never lists nor deletes such a folder.
        problem: why the step is not complete, for people; None when it is complete.
        world_size: the number of ranks DONE records (None where DONE cannot be read).
        files: each rank file's name and size as DONE records them, in rank order (empty where
            DONE cannot be read); the files are in ``folder``.
        own: the entries of the folder that the manager writes (rank files, markers).
        foreign: the other entries: the manager never removes them. (What unfinished writes
            left is no entry: ``Storage.unfinished``.)
    """

    folder: str
    step: int | None
    problem: str | None
    world_size: int | None = None
    files: Mapping[str, int] = dataclasses.field(default_factory=dict)
    own: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return self.problem is None


class Unreadable(Exception):
    """Why a small file of a step folder cannot be taken as it is (the text says)."""


def read_marker(storage: Storage, folder: str, entry: Entry, limit: int) -> bytes:
    """The bytes of a small regular file of a step folder, read without blocking and refused
    above ``limit`` bytes (unread).

    Raises:
        FileNotFoundError: it is gone;
        Unreadable: anything else that keeps it from being read, with why.
    """
    if entry.kind != "file":
        raise Unreadable(f"{entry.name} is " + ("a directory, not a regular file" if entry.kind == "folder" else
                                               NOT_A_FILE))
    try:
        return storage.read_small(storage.join(folder, entry.name), limit)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = e.strerror or str(e)
        raise Unreadable(f"{entry.name} {why}" if e.errno == errno.EFBIG else
                         f"{entry.name} cannot be read: {why}") from e


def parse_done(data: bytes) -> dict[str, Any]:
    """A DONE marker's record, checked for its format (not yet against its folder).

    Raises:
        ValueError: why it is not a DONE marker that the manager writes.
    """
    brackets = data.count(b"[") + data.count(b"{")
    if brackets > DONE_BRACKETS:
        raise ValueError(f"it holds {brackets} brackets, a DONE marker at most {DONE_BRACKETS} (not parsed)")
    try:
        done = json.loads(data.decode("utf-8"))
    except ValueError as e:  # also UnicodeDecodeError
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(done, dict) or done.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT!r} record")
    step, world, files = done.get("step"), done.get("world_size"), done.get("files")
    if not _count(step) or not _count(world) or world == 0:
        raise ValueError(f"its step {step!r} or world size {world!r} is not a whole number")
    if not isinstance(files, dict) or not all(_count(size) for size in files.values()):
        raise ValueError("its 'files' is not a map of names to sizes")
    if len(files) != world:
        raise ValueError(f"it records {len(files)} file(s) for {world} rank(s)")
    return done


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_step(folder: str | os.PathLike[str]) -> StepCheck:
    """Whether a step folder is a complete checkpoint, and if not, why (never raises for what
    the folder holds: a hostile folder is an incomplete step).

    Complete means: DONE is a regular file of at most 4 KiB plus 4 KiB per rank file in the
    folder, parses as the manager's record (at most 16 brackets) of this step, names exactly
    the rank files of its number of ranks, and each is a regular file of the recorded size.
    """
    storage = storage_for(folder)
    path = storage.absolute(os.fspath(folder))
    return _check(storage, path, storage.kind(path))


def _check(storage: Storage, folder: str, kind: Kind | None) -> StepCheck:
    step = step_of(posixpath.basename(folder.rstrip("/")))
    if kind is None:
        return StepCheck(folder, step, f"{folder} cannot be read: nothing is there")
    if kind != "folder":
        return StepCheck(folder, step, f"{folder} is not a folder" + ("" if kind == "file" else
                                                                      " (a symbolic link, or something else)"))
    try:
        entries = {e.name: e for e in storage.list_folder(folder)}
    except OSError as e:
        return StepCheck(folder, step, f"{folder} cannot be read: {e.strerror or e}")
    own = tuple(sorted(n for n in entries if is_manager_file(n)))
    foreign = tuple(sorted(n for n in entries if not is_manager_file(n)))
    try:
        done = _read_done(storage, folder, entries, own)
    except Unreadable as e:
        return StepCheck(folder, step, str(e), own=own, foreign=foreign)
    world, files = done["world_size"], done["files"]
    expected = [file_name(r, world) for r in range(world)]
    if set(files) == set(expected):
        files = {name: files[name] for name in expected}
    problem = _against_folder(storage, folder, done, step, expected, entries)
    return StepCheck(folder, step, problem, world, files, own, foreign)


def _read_done(storage: Storage, folder: str, entries: dict[str, Entry], own: tuple[str, ...]) -> dict[str, Any]:
    rank_files = sum(1 for n in own if n == SINGLE or _RANK_FILE.fullmatch(n))
    entry = entries.get(DONE)
    if entry is None:
        raise Unreadable(_missing_done(storage, folder, entries))
    try:
        return parse_done(read_marker(storage, folder, entry, DONE_BYTES * (1 + rank_files)))
    except FileNotFoundError:  # removed since the listing
        raise Unreadable(_missing_done(storage, folder, entries)) from None
    except ValueError as e:
        raise Unreadable(f"DONE is malformed: {e}") from e


def _against_folder(storage: Storage, folder: str, done: dict[str, Any], step: int | None, expected: list[str],
                    entries: dict[str, Entry]) -> str | None:
    """What is wrong between a well-formed DONE and its folder, or None."""
    if step is not None and done["step"] != step:
        return f"DONE records step {done['step']}, the folder's name step {step}"
    for name in done["files"]:
        if name not in expected:
            path_like = name in (".", "..") or "/" in name or os.sep in name or "\0" in name
            where = "a path, not a plain file name of the step folder" if path_like else \
                f"not a file of a {done['world_size']}-rank step"
            return f"DONE names {name!r}: {where}"
    for name in expected:
        entry, size = entries.get(name), done["files"][name]
        if entry is None:
            return f"{name} is missing"
        if entry.kind != "file":
            return f"{name} is not a regular file"
        try:
            actual = storage.size(storage.join(folder, name))
        except OSError as e:
            return f"{name} cannot be read: {e.strerror or e}"
        if actual != size:
            return f"size mismatch of {name}: DONE records {size} bytes, the file has {actual}"
    return None


def _missing_done(storage: Storage, folder: str, entries: dict[str, Entry]) -> str:
    why = ["no DONE marker (its save did not finish, or is still running)"]
    for name, entry in sorted(entries.items()):
        if name.startswith("FAILED-rank-") and is_manager_file(name):
            text = failure_text(storage, folder, entry)
            why.append(f"rank {int(name[len('FAILED-rank-'):])} failed" + (f": {text}" if text else ""))
    return "; ".join(why)


def failure_text(storage: Storage, folder: str, entry: Entry) -> str:
    """What a FAILED marker says (or why it cannot be read)."""
    try:
        return read_marker(storage, folder, entry, MARKER_BYTES).decode("utf-8", "replace").strip()
    except (OSError, Unreadable) as e:
        return str(e)


def check_steps(directory: str | os.PathLike[str]) -> list[StepCheck]:
    """``check_step`` of every step folder of a manager's directory, in step order."""
    storage = storage_for(directory)
    found = step_dirs(storage.absolute(os.fspath(directory)))
    return [_check(storage, folder, "folder") for folder in found.values()]


def complete_steps(directory: str) -> list[int]:
    return [c.step for c in check_steps(directory) if c.complete and c.step is not None]


def read_done(folder: str) -> dict[str, Any] | None:
    """The record of a complete step (``world_size``, ``files``), else None."""
    check = check_step(folder)
    return {"world_size": check.world_size, "files": dict(check.files)} if check.complete else None


# --- writing and removing ---------------------------------------------------------------------


def make_step_dir(directory: str, step: int) -> str:
    """The step's folder, made now or by another rank; never a link or a file in its place."""
    storage, folder = storage_for(directory), step_dir(directory, step)
    with contextlib.suppress(FileExistsError):  # something in the way: said below
        storage.make_folders(folder)
    if storage.kind(folder) not in ("folder", None):  # None: a storage whose folders are prefixes
        raise FileExistsError(errno.EEXIST, "is in the way of the step's folder, and not a folder the manager "
                              "made: move it away", folder)
    return folder


def write_marker(folder: str, name: str, data: bytes) -> None:
    """Publish the marker ``name`` of a step folder (``write_small``: atomically, durably);
    what is in its place and not a file (a link: the publish must not follow it) goes first."""
    storage = storage_for(folder)
    path = storage.join(folder, name)
    if storage.kind(path) not in (None, "file"):
        storage.remove(path, missing_ok=True)
    storage.write_small(path, data)


def write_done(directory: str, step: int, world_size: int) -> None:
    """Publish the DONE marker of ``step`` (every rank's file is durable by now)."""
    storage, folder = storage_for(directory), step_dir(directory, step)
    storage.sync_folder(folder)  # every rank's file there, before the marker that counts them
    storage.sync_folder(directory)  # and the step folder's own entry
    files = {}
    for name in (file_name(r, world_size) for r in range(world_size)):
        path = storage.join(folder, name)
        kind = storage.kind(path)
        if kind != "file":
            raise OSError(errno.ENOENT if kind is None else errno.EINVAL,
                          f"is {'missing' if kind is None else 'not a regular file'}: the step cannot be counted", path)
        files[name] = storage.size(path)
    data = (json.dumps({"format": FORMAT, "step": step, "world_size": world_size, "files": files}, indent=1)
            + "\n").encode()
    write_marker(folder, DONE, data)


def remove_step(directory: str, folder: str) -> tuple[str, ...]:
    """Delete a step: its DONE marker first, durably, so that a crash midway leaves an
    incomplete step (ignored), never a complete step with files missing; then the other files
    the manager writes, then the folder, unless it holds files of others.

    Returns:
        the entries left in the folder (then kept).
    """
    storage = storage_for(directory)
    done = storage.join(folder, DONE)
    if storage.kind(done) not in (None, "folder"):
        storage.remove(done, missing_ok=True)
        storage.sync_folder(folder)
    try:
        entries = storage.list_folder(folder)
    except FileNotFoundError:
        return ()
    for entry in entries:
        if entry.name != DONE and entry.kind != "folder" and is_manager_file(entry.name):
            storage.remove(storage.join(folder, entry.name), missing_ok=True)
    for name in storage.unfinished(folder):  # what unfinished writes of its files left
        if is_manager_file(name):
            storage.remove_temps(storage.join(folder, name), stale_only=False)
    try:
        storage.remove_folder(folder)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return tuple(sorted({*listing(folder), *storage.unfinished(folder)}))
    storage.sync_folder(directory)
    return ()


def remove_own_leftovers(directory: str, rank: int, world_size: int) -> None:
    """Remove this rank's files (and what unfinished writes of them left, and markers) from
    incomplete step folders: a later save of one of those steps must not find them there. Only
    this rank's writing manager runs this (it holds the rank's lock), so none of them is being
    written."""
    storage = storage_for(directory)
    mine = {file_name(rank, world_size), failed_name(rank), ready_name(rank)}
    for check in check_steps(directory):
        if not check.complete:
            for name in mine & set(check.own):
                storage.remove(storage.join(check.folder, name), missing_ok=True)
            for name in mine & set(storage.unfinished(check.folder)):
                storage.remove_temps(storage.join(check.folder, name), stale_only=False)
