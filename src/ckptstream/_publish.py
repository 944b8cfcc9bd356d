"""Atomic, durable publication of a file: write a temp beside the target, fsync it, rename it
over the target, fsync the directory. A reader sees the old complete file or the new complete
file, never a mix; a crash leaves at most a temp, which the next writer of the path removes
once its writer is gone."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator

from . import _fileio
from ._fileio import OpenFile

TEMP_MARK = ".ckptstream-tmp-"


def temp_path_for(path: str) -> str:
    """A unique temp name beside ``path``, naming the writer's host and pid so that a later
    writer can tell a stale one (its writer gone) from a live one."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def remove_stale_temps(path: str) -> list[str]:
    """Delete temp files of ``path`` left by writers on this host that no longer run."""
    directory, name = os.path.split(path)
    prefix = f".{name}{TEMP_MARK}{socket.gethostname()}-"
    removed = []
    for entry in os.listdir(directory or "."):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))
                removed.append(entry)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _fileio.fsync(fd, directory)
    finally:
        os.close(fd)


def check_target(path: str) -> str:
    """The absolute path to publish at; raises before anything is written when it cannot be."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, "the directory to save into does not exist; create it first", directory)
    return path


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[OpenFile]:
    """A new temp file beside ``path`` to write; when the block succeeds it is fsynced and
    renamed over ``path``, and the directory fsynced. When the block fails the temp is removed
    and ``path`` is untouched."""
    path = check_target(path)
    remove_stale_temps(path)
    temp = temp_path_for(path)
    handle: OpenFile | None = None
    try:
        try:
            handle = OpenFile(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), temp, owned=True)
        except OSError as e:
            raise _fileio.os_error(e, "creating the temp file", temp) from e
        yield handle
        _fileio.fsync(handle.fd, temp)
        handle.close()
        os.replace(temp, path)
        fsync_dir(os.path.dirname(path))
    except BaseException:
        if handle is not None:
            handle.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
