"""The storage seam: what the engines, the readers and the checkpoint API ask of the place a
checkpoint lives, and nothing more.

    source = storage_for(path).open(path)      # a target to read: size, positional reads
    with storage_for(path).create(path) as sink:
        sink.write_at(view, offset)           # any thread, any order
    # leaving the block publishes the new object atomically and durably (or, on an error,
    # abandons it: the old object stays as it was)

A ``Storage`` is a namespace of targets (a local file system; an object store's bucket): it
opens ``Source``s and creates ``Sink``s, lists, removes and syncs what the checkpoint manager
keeps there, and holds the manager's writer locks. Positional and vectored I/O and the publish
protocol are part of the seam because speed (reads and writes from several threads straight into and out of the staging
buffers) and safety (a reader sees the old complete object or the new one) come from them.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import posixpath
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from .._settings import DirectIO

Kind = Literal["file", "folder", "other"]
S = TypeVar("S", bound="Sink")
R = TypeVar("R", bound="Source")


def round_down(value: int, align: int) -> int:
    return value - value % align


def round_up(value: int, align: int) -> int:
    return -(-value // align) * align


@dataclasses.dataclass(frozen=True)
class Entry:
    """One name in a folder: a file (an object), a folder (a prefix), or something else (a
    symbolic link, a FIFO, a device: never followed)."""

    name: str
    kind: Kind


class LockHeldError(OSError):
    """``Storage.lock``: another writer holds the lock; ``holder`` is what it wrote there (for
    the refused writer's message; empty where it cannot be read)."""

    def __init__(self, path: str, holder: bytes) -> None:
        super().__init__(errno.EWOULDBLOCK, "held by another writer", path)
        self.holder = holder


class Lock(abc.ABC):
    """A writer lock, held until ``close`` (see ``Storage.lock``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the lock; safe to call twice. In a forked child (which never holds its
        parent's locks): nothing, the parent's lock stays held."""

    def check(self) -> None:
        """Raise LockHeldError (with the other writer's ``holder``) where another writer has
        taken the lock since: a store without a lock (an object store) holds the writer's
        record instead, which a later writer replaces. Nothing where the lock cannot be lost."""
        return


class Target(abc.ABC):
    """What sources and sinks share: a name for messages and the grid transfers are planned on."""

    name: str  # the path or URL, for messages

    @abc.abstractmethod
    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        """The alignment the engine plans one transfer's chunks on (1: anywhere): every chunk
        but a run's first starts on a multiple of it, and covers at most ``buffer_size`` bytes
        from a multiple of it. Called once per transfer, before its first read or write, with
        the transfer's settings; may prepare what those reads or writes need (a local file's
        O_DIRECT twin) and raises where ``direct_io`` asks for what the target cannot do."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the target holds (descriptors, connections); safe to call twice."""


class Sink(Target):
    """A target opened for writing. Nothing is visible under its name until ``publish``; then
    all of it is, atomically and durably. ``abandon`` drops it instead. As a context manager:
    published when the block ends normally (unless it was already), abandoned when it raises."""

    @abc.abstractmethod
    def write_at(self, view: memoryview, offset: int) -> None:
        """Write all of ``view`` at byte ``offset``; from any thread, in any order. Raises
        OSError (naming the target) where the bytes cannot be written; never writes fewer."""

    @abc.abstractmethod
    def publish(self) -> None:
        """Make the written bytes the target's, atomically (a reader sees the old object or the
        new one, never a mix) and durably; then the sink is closed. Where it raises, nothing
        new is visible, unless the message says otherwise (a local file system's directory
        fsync fails after the rename)."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Drop what was written (the old object, if any, stays as it was) and close; never
        raises. Nothing happens after ``publish``."""

    def seal(self) -> None:
        """End the writes: make the written bytes durable and release what the sink holds
        (descriptors), without publishing them; ``publish`` then only names them, and
        ``abandon`` still drops them. For a writer of many objects that are published together
        at the end. A no-op where unpublished bytes hold nothing (an upload's parts) and for
        sinks whose ``publish`` does it all."""

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.publish()
        else:
            self.abandon()


class Region(Protocol):
    """A private, copy-on-write mapping of some of a source's bytes (see ``Source.map``)."""

    @property
    def buffer(self) -> Any:
        """The mapped bytes, writable (writes stay in this process), exported through the buffer
        protocol; the mapping lives as long as it and every object made from it."""

    def prefetch(self, lo: int, hi: int) -> bool:
        """Bring bytes [lo, hi) of the mapping into memory now, in few calls (a hint); whether
        it was taken."""

    def resident(self, lo: int, hi: int) -> bool:
        """Whether bytes [lo, hi) look to be in memory already (a hint, maybe from a sample):
        then reading them costs less than ``prefetch`` does."""


class Source(Target):
    """A target opened for reading. As a context manager: closed when the block ends."""

    @abc.abstractmethod
    def size(self) -> int:
        """The target's length in bytes, as it is now."""

    @abc.abstractmethod
    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from byte ``offset``; returns the bytes read, fewer only where the
        target ends. From any thread."""

    def readv_into(self, views: Sequence[memoryview], offset: int) -> int:
        """Fill ``views`` one after another from byte ``offset`` (back-to-back bytes into many
        buffers, in few requests where the target allows); returns the bytes read, fewer only
        where the target ends."""
        done = 0
        for view in views:
            got = self.read_into(view, offset + done)
            done += got
            if got < len(view):
                break
        return done

    # whether each I/O thread should read one contiguous range through its own ``reader``
    # (a local file's readahead follows such streams); else the threads take chunks in turn
    sequential_readers: ClassVar[bool] = False

    def reader(self, resident: bool = False) -> Source:
        """A reader of the same bytes for one I/O thread, closed by that thread when it is done
        (``close``). A local file gives each thread a descriptor of its own, with readahead
        advised: the kernel then follows each thread's sequential stream instead of one mixed
        stream. ``resident``: the bytes are in memory already (``resident_fraction``), so no
        readahead needs to run ahead of the reads. Elsewhere the source itself (a thread closes
        only a reader that is not its source)."""
        return self

    def descriptor(self) -> int | None:
        """An open descriptor whose positional reads give this source's bytes, as ``read_into``
        does (a local file read without O_DIRECT), for the read engine's native loop; None
        where there is none."""
        return None

    def resident_fraction(self, offset: int, length: int) -> float | None:
        """The fraction of bytes offset..offset+length already in memory (a local file's page
        cache): a hint for how many readers pay. None where unknown."""
        return None

    def map(self, offset: int, length: int) -> Region | None:
        """A private mapping of ``length`` bytes from ``offset`` (a multiple of the page size),
        whose pages are read when first touched; None where the target cannot be mapped."""
        return None

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Storage(abc.ABC):
    """A namespace of targets named by paths (a local file system) or URLs (a bucket)."""

    @abc.abstractmethod
    def open(self, path: str) -> Source:
        """``path`` opened for reading. Raises FileNotFoundError where it does not exist, and
        OSError (without blocking) where it is not a file: a folder, a FIFO, a device."""

    @abc.abstractmethod
    def create(self, path: str) -> Sink:
        """A sink that publishes to ``path`` (replacing what is there, atomically). Raises
        before anything is written where it cannot (see ``check_target``); clears what dead
        writers of ``path`` left (``remove_temps``)."""

    @abc.abstractmethod
    def check_target(self, path: str) -> str:
        """The name ``create(path)`` would publish under (a local file system: the absolute path
        through symbolic links); raises now where a sink could not be created there (a folder, a
        FIFO, a missing parent folder), before a caller does work for it."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The length of the file ``path``; FileNotFoundError where there is none."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` names a file or a folder."""

    @abc.abstractmethod
    def kind(self, path: str) -> Kind | None:
        """What ``path`` names, as ``list_folder`` would say it (a symbolic link is not
        followed: "other"), or None where nothing is there."""

    @abc.abstractmethod
    def list_folder(self, folder: str) -> list[Entry]:
        """The entries of ``folder``, sorted by name; FileNotFoundError where there is none.
        What unfinished writes left (a local temp file, an incomplete upload) is no entry:
        ``unfinished`` names the targets it was for."""

    @abc.abstractmethod
    def remove(self, path: str, *, missing_ok: bool = False) -> None:
        """Remove the file ``path`` (FileNotFoundError where there is none, unless ``missing_ok``)."""

    @abc.abstractmethod
    def remove_tree(self, folder: str) -> None:
        """Remove ``folder`` and everything in it; nothing happens where there is none."""

    @abc.abstractmethod
    def remove_folder(self, folder: str) -> None:
        """Remove the empty folder ``folder``; nothing happens where there is none. Raises
        OSError with errno ENOTEMPTY where it holds entries (they stay)."""

    @abc.abstractmethod
    def make_folders(self, folder: str) -> None:
        """Create ``folder`` and any missing parents (nothing where they exist)."""

    @abc.abstractmethod
    def sync_folder(self, folder: str) -> None:
        """Make the entries of ``folder`` (names created, renamed or removed in it) durable; a
        no-op where every name change is durable once made (object stores)."""

    @abc.abstractmethod
    def remove_temps(self, path: str, *, stale_only: bool = True) -> list[str]:
        """Remove what unfinished writes of ``path`` left (a local file system: temp files
        beside it; an object store: incomplete uploads): with ``stale_only``, only those whose
        writers are certainly gone. Returns what was removed; never raises."""

    @abc.abstractmethod
    def unfinished(self, folder: str) -> list[str]:
        """The names of the targets in ``folder`` that unfinished writes left something of
        (what ``remove_temps`` of that name would look at), whether or not a file of the name
        exists; names too long to be told from their leftovers may be missing. Never raises."""

    @abc.abstractmethod
    def read_small(self, path: str, limit: int) -> bytes:
        """All of the small file ``path`` (a marker, a metadata file): FileNotFoundError where
        there is none, OSError (without blocking) where it is not a file or holds more than
        ``limit`` bytes."""

    @abc.abstractmethod
    def lock(self, path: str, holder: bytes) -> Lock:
        """Take the writer lock named ``path``, held until the returned lock is closed: until
        then every other ``lock(path)``, of this process or another, raises LockHeldError with
        ``holder`` (a few hundred bytes saying who holds it, different for each holder). A
        holder that dies releases it (a lock that outlived its writer would stop every later
        writer); a forked child does not hold its parent's locks. A store that has no such lock
        (an object store) gives a record instead, which the next writer takes over: the
        holder's ``check`` then raises. Raises OSError where the lock cannot be made."""

    def absolute(self, path: str) -> str:
        """``path`` in a form that names the same place whatever the working directory (a local
        path made absolute; a URL as it is)."""
        return path

    def write_small(self, path: str, data: bytes) -> None:
        """Publish ``data`` as the file ``path``, atomically and durably (``create``)."""
        with self.create(path) as sink:
            sink.write_at(memoryview(data), 0)

    def join(self, folder: str, *names: str) -> str:
        """The path of ``names`` inside ``folder``."""
        return posixpath.join(folder, *names)
