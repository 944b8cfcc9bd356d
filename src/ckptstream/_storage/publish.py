"""The parts of a local file's atomic, durable publication (``files.AtomicSink`` runs them):
write a temp beside the target, fsync it, rename it over the target, fsync the directory. A
reader sees the old complete file or the new complete file, never a mix; a crash leaves at most
a temp, which a later writer of the path removes once its writer is certainly gone.

The target is the file a path names: through symbolic links (the link stays a link and its
target is replaced, in the target's directory), and a file being replaced keeps its mode and,
where the OS permits, its owner and group.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import stat
import time
import uuid
import zlib

from . import fileio

TEMP_MARK = ".ckptstream-tmp-"
# a temp untouched for this long is removed by the next save of its path, whoever wrote it: a
# live writer keeps writing to its temp, so only a writer stalled this long could lose one
STALE_AFTER_S = 24 * 3600
_NAME_BUDGET = 100  # bytes of the target's name kept in its temps' names (NAME_MAX is 255)
# HOST-PIDNS-PID-RAND after the mark; the host name may hold dashes, so parsed from the right
_TEMP_TAIL = re.compile(r"(?P<host>.*)-(?P<ns>\d+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]{12})")
_ANY_TAIL = re.compile(r".*-\d+-[0-9a-f]{12}")  # any ckptstream temp, also those without PIDNS


def pid_namespace() -> int:
    """The inode of this process's PID namespace, 0 where unknown: a pid names the same process
    only within one namespace (a container has its own)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _temp_prefix(path: str) -> tuple[str, str]:
    """The directory and the start of the names of ``path``'s temps. A long name is shortened
    (with a hash of the whole) so that a temp's name stays within the file system's limit."""
    directory, name = os.path.split(path)
    raw = os.fsencode(name)
    if len(raw) > _NAME_BUDGET:
        short = name
        while len(os.fsencode(short)) > _NAME_BUDGET - 9:
            short = short[:-1]
        name = f"{short}~{zlib.crc32(raw):08x}"
    return directory, f".{name}{TEMP_MARK}"


def temp_path_for(path: str) -> str:
    """A unique temp name beside ``path``, naming the writer's host, PID namespace and pid so
    that a later writer can tell a dead writer's temp from a live one's."""
    directory, prefix = _temp_prefix(path)
    tail = f"{socket.gethostname()}-{pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return os.path.join(directory, prefix + tail)


def temp_target(entry: str) -> str | None:
    """The name a temp beside it was written for, where the folder entry ``entry`` is one (a name
    shortened in its temps' names comes back shortened); else None."""
    if not entry.startswith(".") or TEMP_MARK not in entry:
        return None
    name, _, tail = entry[1:].partition(TEMP_MARK)
    return name if name and _ANY_TAIL.fullmatch(tail) else None


def temps_targets(directory: str) -> list[str]:
    """The names whose temps lie in ``directory`` (not those shortened to fit NAME_MAX)."""
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return []
    names = {name for e in entries if (name := temp_target(e)) is not None}
    return sorted(n for n in names if "~" not in n)


def remove_stale_temps(path: str, stale_only: bool = True) -> list[str]:
    """Delete the temps of ``path`` whose writers are certainly gone: written on this host, in
    this PID namespace, by a process that no longer exists; or untouched for STALE_AFTER_S
    (without ``stale_only``: every temp of ``path``). Never raises: a leftover that cannot be
    removed (another user's, in a sticky directory) stays, and the save goes on."""
    directory, prefix = _temp_prefix(path)
    host, ns, now = socket.gethostname(), pid_namespace(), time.time()
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        temp = os.path.join(directory, entry)
        if not stale_only or _is_stale(entry[len(prefix) :], temp, host, ns, now):
            try:
                os.unlink(temp)
            except OSError:
                continue
            removed.append(entry)
    return removed


def _is_stale(tail: str, temp: str, host: str, ns: int, now: float) -> bool:
    m = _TEMP_TAIL.fullmatch(tail)
    if m and ns and m["host"] == host and int(m["ns"]) == ns and not process_alive(int(m["pid"])):
        return True
    if not _ANY_TAIL.fullmatch(tail):
        return False  # not a name ckptstream makes: never removed
    try:
        return now - os.lstat(temp).st_mtime > STALE_AFTER_S
    except OSError:
        return False


def process_alive(pid: int) -> bool:
    """False only where ``pid`` certainly names no process (of this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's process, alive
        return True
    return True


def target_of(path: str | os.PathLike[str]) -> tuple[str, os.stat_result | None]:
    """The file to replace (through symbolic links) and its status (None: a new file)."""
    given = os.path.abspath(os.fsdecode(path))
    target = os.path.realpath(given)
    if os.path.islink(target):
        raise OSError(errno.ELOOP, "the symbolic links of this path form a loop", given)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, "the directory to save into does not exist; create it first", directory)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, None
    except OSError as e:
        raise fileio.os_error(e, "looking at the file to replace", target) from e
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory; save writes a file: give a file path (in it)", given)
    if not stat.S_ISREG(st.st_mode):
        fileio.check_file_type(st, given, "save replaces a regular file (renames a new one over it): give the "
                                "path of a file")
    return target, st


def check_target(path: str | os.PathLike[str]) -> str:
    """The absolute path of the file to publish (a symbolic link's target); raises before
    anything is written when it cannot be: a directory, a FIFO or device, a missing directory."""
    return target_of(path)[0]


def keep_owner_and_mode(fd: int, old: os.stat_result) -> None:
    """Give the new file the replaced file's owner and group (where permitted: root may, others
    may keep the group) and then its mode (a change of owner clears set-id bits)."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (old.st_uid, old.st_gid):
        try:
            os.fchown(fd, old.st_uid, old.st_gid)
        except OSError:
            with contextlib.suppress(OSError):
                os.fchown(fd, -1, old.st_gid)
    with contextlib.suppress(OSError):  # a file system without modes; the temp stays 0600 then
        os.fchmod(fd, stat.S_IMODE(old.st_mode))


def discard(temp: str) -> None:
    """Remove the temp, after closing any descriptor of it that an interrupt left unrecorded."""
    fileio.close_strays(temp)
    with contextlib.suppress(OSError):
        os.unlink(temp)
