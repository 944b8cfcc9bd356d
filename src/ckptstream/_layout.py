"""The directory of a CheckpointManager: one folder per step, one file per rank, a DONE marker.

    DIR/step-000000001200/state.safetensors                (one process)
    DIR/step-000000001200/rank-00003-of-00008.safetensors  (several: one file per rank)
    DIR/step-000000001200/DONE                             JSON, published last, atomically
    DIR/step-000000001200/FAILED-rank-00003                a rank's save failed (no process group)
    DIR/step-000000001200/READY-rank-00003                 a rank is ready for the step (no process group)
    DIR/.lock-rank-00003                                   held by the rank's writing manager (``_dirlock``)

Only ``step-`` and exactly 12 ASCII digits name a step. A step is complete when its DONE marker
is a small regular file of the format below naming exactly the rank files of the step, which all
exist as regular files with the sizes it records: DONE is published (temp, fsync, rename, folder
fsync) only once every rank's file is durable, and removed first (and that removal made durable)
when a step is deleted. Anything else is an incomplete step, whatever it holds: ignored by the
listing, removed later. The manager removes only the files it writes (the names above and their
temps): a folder holding anything else stays, with that inside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from . import _fileio
from ._publish import TEMP_MARK, atomic_file, fsync_dir

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
_STEP_DIR = re.compile(r"step-([0-9]{12})")
_RANK_FILE = re.compile(r"rank-([0-9]{5,})-of-([0-9]{5,})\.safetensors")
_MARKER = re.compile(r"(?:FAILED|READY)-rank-([0-9]{5,})")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:012d}")


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


def temp_prefix(name: str) -> str:
    """The start of the names of ``name``'s temps (``_publish``'s rule for short names)."""
    return f".{name}{TEMP_MARK}"


def is_manager_file(name: str) -> bool:
    """Whether a step folder's entry is one the manager or its ranks write (or its temp)."""
    if name.startswith(".") and TEMP_MARK in name:
        name = name[1 : name.index(TEMP_MARK)]
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
    found: dict[int, str] = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(directory):
            step = step_of(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found[step] = entry.path
    return dict(sorted(found.items()))


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
        own: the entries of the folder that the manager writes (rank files, markers, temps).
        foreign: the other entries: the manager never removes them.
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


def read_small(path: str, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, opened without blocking and
    without following a symbolic link (a FIFO, a device or a link is refused unopened).

    Raises:
        FileNotFoundError: there is none;
        Unreadable: anything else that keeps it from being read, with why.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else _fileio._KINDS.get(stat.S_IFMT(st.st_mode),
                                                                                     "something else")
        raise Unreadable(f"{what} is {kind}, not a regular file")
    if st.st_size > limit:
        raise Unreadable(f"{what} is {st.st_size} bytes, over its limit of {limit}")
    try:
        fd = _fileio.open_path(path, os.O_RDONLY | os.O_NOFOLLOW, f"reading {what}")
    except OSError as e:
        raise Unreadable(f"{what} cannot be read: {e.strerror or e}") from e
    try:
        data = b""
        while len(data) <= limit:  # the file may grow after the checks: read one byte past the limit
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                return data
            data += chunk
    except OSError as e:
        raise Unreadable(f"{what} cannot be read: {e.strerror or e}") from e
    finally:
        os.close(fd)
    raise Unreadable(f"{what} is over its limit of {limit} bytes")


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
    folder = os.path.abspath(os.fspath(folder))
    step = step_of(os.path.basename(folder))
    try:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
            return StepCheck(folder, step, f"{folder} is {kind}")
        entries = {e.name: e for e in os.scandir(folder)}
    except OSError as e:
        return StepCheck(folder, step, f"{folder} cannot be read: {e.strerror or e}")
    own = tuple(sorted(n for n in entries if is_manager_file(n)))
    foreign = tuple(sorted(n for n in entries if not is_manager_file(n)))
    try:
        done = _read_done(folder, own)
    except Unreadable as e:
        return StepCheck(folder, step, str(e), own=own, foreign=foreign)
    world, files = done["world_size"], done["files"]
    expected = [file_name(r, world) for r in range(world)]
    if set(files) == set(expected):
        files = {name: files[name] for name in expected}
    return StepCheck(folder, step, _against_folder(done, step, expected, entries), world, files, own, foreign)


def _read_done(folder: str, own: tuple[str, ...]) -> dict[str, Any]:
    rank_files = sum(1 for n in own if n == SINGLE or _RANK_FILE.fullmatch(n))
    try:
        return parse_done(read_small(os.path.join(folder, DONE), DONE_BYTES * (1 + rank_files), DONE))
    except FileNotFoundError:
        raise Unreadable(_missing_done(folder, own)) from None
    except OSError as e:
        raise Unreadable(f"DONE cannot be read: {e.strerror or e}") from e
    except ValueError as e:
        raise Unreadable(f"DONE is malformed: {e}") from e


def _against_folder(done: dict[str, Any], step: int | None, expected: list[str],
                    entries: dict[str, os.DirEntry[str]]) -> str | None:
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
        if not entry.is_file(follow_symlinks=False):
            return f"{name} is not a regular file"
        actual = entry.stat(follow_symlinks=False).st_size
        if actual != size:
            return f"size mismatch of {name}: DONE records {size} bytes, the file has {actual}"
    return None


def _missing_done(folder: str, own: tuple[str, ...]) -> str:
    why = ["no DONE marker (its save did not finish, or is still running)"]
    for name in own:
        if name.startswith("FAILED-rank-"):
            try:
                text = read_small(os.path.join(folder, name), MARKER_BYTES, name).decode("utf-8", "replace").strip()
            except (OSError, Unreadable) as e:
                text = str(e)
            why.append(f"rank {int(name[len('FAILED-rank-'):])} failed: {text}")
    return "; ".join(why)


def check_steps(directory: str | os.PathLike[str]) -> list[StepCheck]:
    """``check_step`` of every step folder of a manager's directory, in step order."""
    return [check_step(folder) for folder in step_dirs(os.path.abspath(os.fspath(directory))).values()]


def complete_steps(directory: str) -> list[int]:
    return [c.step for c in check_steps(directory) if c.complete and c.step is not None]


def read_done(folder: str) -> dict[str, Any] | None:
    """The record of a complete step (``world_size``, ``files``), else None."""
    check = check_step(folder)
    return {"world_size": check.world_size, "files": dict(check.files)} if check.complete else None


# --- writing and removing ---------------------------------------------------------------------


def make_step_dir(directory: str, step: int) -> str:
    """The step's folder, made now or by another rank; never a link or a file in its place."""
    folder = step_dir(directory, step)
    try:
        os.mkdir(folder)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise FileExistsError(errno.EEXIST, "is in the way of the step's folder, and not a folder the manager "
                                  "made: move it away", folder) from None
    return folder


def write_done(directory: str, step: int, world_size: int) -> None:
    """Publish the DONE marker of ``step`` (every rank's file is durable by now)."""
    folder = step_dir(directory, step)
    fsync_dir(folder)  # every rank's file there, before the marker that counts them
    fsync_dir(directory)  # and the step folder's own entry
    files = {}
    for name in (file_name(r, world_size) for r in range(world_size)):
        st = os.lstat(os.path.join(folder, name))
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file: the step cannot be counted", os.path.join(folder, name))
        files[name] = st.st_size
    data = (json.dumps({"format": FORMAT, "step": step, "world_size": world_size, "files": files}, indent=1)
            + "\n").encode()
    done = os.path.join(folder, DONE)
    with contextlib.suppress(FileNotFoundError):  # a stale one: the publish below must not follow a link there
        if not stat.S_ISREG(os.lstat(done).st_mode):
            os.unlink(done)
    with atomic_file(done) as file:
        _fileio.pwrite_all(file.fd, memoryview(data), 0, file.path)


def remove_step(directory: str, folder: str) -> tuple[bool, tuple[str, ...]]:
    """Delete a step: its DONE marker first, durably, so that a crash midway leaves an
    incomplete step (ignored), never a complete step with files missing; then the other files
    the manager writes, then the folder, unless it holds files of others.

    Returns:
        whether anything was removed, and the entries left in the folder (then kept).
    """
    removed = False
    done = os.path.join(folder, DONE)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(done).st_mode):
            os.unlink(done)
            fsync_dir(folder)
            removed = True
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return removed, ()
    for entry in entries:
        if entry.name != DONE and is_manager_file(entry.name) and not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed = True
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return removed, tuple(sorted(os.listdir(folder)))
    fsync_dir(directory)
    return True, ()


def remove_own_leftovers(directory: str, rank: int, world_size: int) -> None:
    """Remove this rank's files (and temps, and markers) from incomplete step folders: a later
    save of one of those steps must not find them there. Only this rank's writing manager runs
    this (it holds the rank's lock), so none of them is being written."""
    mine = (file_name(rank, world_size), failed_name(rank), ready_name(rank))
    for check in check_steps(directory):
        if check.complete:
            continue
        for name in check.own:
            if name in mine or name.startswith(tuple(temp_prefix(m) for m in mine)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(check.folder, name))
