"""An in-memory storage for the tests, served for ``mem://`` URLs through the same dispatch as
any storage (``ckptstream._storage.register``), with fault injection.

Objects are bytes in a dict, published atomically (one dict assignment); a sink's bytes stay in
``pending`` until then, like an object store's incomplete upload. Faults (``Faults``): the Nth
write or read fails, reads stop early (an object cut short under an open reader), publishing
fails, or the process "crashes" at a step (``Crash``: nothing after it runs, not even the
abandon of the sink, so what it left is what a killed writer leaves). A storage may also ask
for a grid, as an object store asks for its part size, and keeps every write's range.

    store = MemStorage()
    register("mem", lambda: store)
    ckptstream.save(state, "mem://run/ckpt.safetensors")
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import threading
from collections.abc import Callable
from typing import Literal

from ckptstream._settings import DirectIO
from ckptstream._storage import Entry, Kind, Lock, LockHeldError, Sink, Source, Storage

Step = Literal["write", "read", "publish"]


class Crash(BaseException):
    """The process died here: nothing after this runs (a BaseException, like SystemExit)."""


def eio(name: str) -> OSError:
    return OSError(errno.EIO, "Input/output error (injected)", name)


@dataclasses.dataclass
class Faults:
    """What goes wrong, counted over every sink and source of the storage (1-based)."""

    fail_write: int | None = None  # this write_at raises ``error``
    fail_read: int | None = None  # this read_into raises ``error``
    error: Callable[[str], BaseException] = eio
    reads_end_at: int | None = None  # reads see every object end here (sizes do not)
    fail_publish: bool | str = False  # publish raises ``error``, nothing becomes visible (a str: of names ending so)
    crash: tuple[Step, int] | None = None  # ("write", 3): the process dies in the third write


class MemStorage(Storage):
    """Objects by name (``mem://space/folder/name``); folders are the prefixes of names, or made."""

    def __init__(self, grid: int = 1) -> None:
        self.objects: dict[str, bytes] = {}
        self.folders: set[str] = set()
        self.pending: dict[int, MemSink] = {}  # unpublished sinks, by id: live or left by a crash
        self.faults = Faults()
        self.grid = grid
        self.calls: dict[str, int] = {}  # operations made, by name
        self.reads: list[tuple[int, int]] = []  # (offset, length) of every read, in order
        self.mutex = threading.Lock()
        self._ids = itertools.count()
        self._writes = itertools.count(1)
        self._reads = itertools.count(1)
        self.dead = False  # a Crash happened: the sinks of the dead process do nothing more
        self.process = 0  # the writing process: sinks belong to the one that made them
        self.gone: set[int] = set()  # processes that crashed
        self.locks: dict[str, MemLock] = {}  # writer locks held, by name

    # --- faults -----------------------------------------------------------------------------

    def count(self, op: str) -> None:
        with self.mutex:
            self.calls[op] = self.calls.get(op, 0) + 1

    def step(self, op: Step, name: str) -> None:
        """Count one ``op`` and raise the fault planned for it, if any."""
        self.count(op)
        f = self.faults
        n = next(self._writes if op == "write" else self._reads) if op != "publish" else self.calls["publish"]
        if f.crash == (op, n):
            self.dead = True
            raise Crash(f"crashed in {op} {n} of {name}")
        publish_fails = f.fail_publish is True or (isinstance(f.fail_publish, str) and name.endswith(f.fail_publish))
        if (op == "write" and f.fail_write == n) or (op == "read" and f.fail_read == n) or (
                op == "publish" and publish_fails):
            raise f.error(name)

    def restart(self) -> None:
        """A new process after a crash: faults cleared, the dead process's uploads still pending."""
        self.gone.add(self.process)
        self.process += 1
        self.faults, self.dead = Faults(), False

    def flip(self, name: str, offset: int) -> None:
        """Corrupt one bit of the byte at ``offset`` of the object ``name``."""
        data = bytearray(self.objects[name])
        data[offset] ^= 0x01
        self.objects[name] = bytes(data)

    # --- the storage ------------------------------------------------------------------------

    def open(self, path: str) -> MemSource:
        self.count("open")
        if path not in self.objects:
            if self._is_folder(path):
                raise IsADirectoryError(errno.EISDIR, "is a folder", path)
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return MemSource(self, path, self.objects[path])

    def create(self, path: str) -> MemSink:
        self.check_target(path)
        self.remove_temps(path)
        sink = MemSink(self, path, next(self._ids))
        with self.mutex:
            self.pending[sink.id] = sink
        return sink

    def check_target(self, path: str) -> str:
        if self._is_folder(path):
            raise IsADirectoryError(errno.EISDIR, "is a folder; give the name of an object in it", path)
        return path

    def size(self, path: str) -> int:
        if path not in self.objects:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return len(self.objects[path])

    def exists(self, path: str) -> bool:
        return path in self.objects or self._is_folder(path)

    def kind(self, path: str) -> Kind | None:
        if path in self.objects:
            return "file"
        return "folder" if self._is_folder(path) else None

    def list_folder(self, folder: str) -> list[Entry]:
        prefix = folder.rstrip("/") + "/"
        if not self._is_folder(folder):
            raise FileNotFoundError(errno.ENOENT, "no such folder", folder)
        found: dict[str, Entry] = {}
        for name in [*self.objects, *self.folders]:
            if name.startswith(prefix) and name != prefix:
                head, sep, _ = name[len(prefix) :].partition("/")
                found[head] = Entry(head, "folder" if sep or name in self.folders else "file")
        return sorted(found.values(), key=lambda e: e.name)

    def remove(self, path: str, *, missing_ok: bool = False) -> None:
        if self.objects.pop(path, None) is None and not missing_ok:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)

    def remove_tree(self, folder: str) -> None:
        prefix = folder.rstrip("/") + "/"
        for name in [n for n in self.objects if n.startswith(prefix)]:
            del self.objects[name]
        self.folders = {f for f in self.folders if f != folder.rstrip("/") and not f.startswith(prefix)}

    def remove_folder(self, folder: str) -> None:
        prefix = folder.rstrip("/") + "/"
        if any(n.startswith(prefix) for n in [*self.objects, *self.folders]):
            raise OSError(errno.ENOTEMPTY, "the folder holds entries", folder)
        self.folders.discard(folder.rstrip("/"))

    def make_folders(self, folder: str) -> None:
        self.folders.add(folder.rstrip("/"))

    def sync_folder(self, folder: str) -> None:
        self.count("sync_folder")  # names are atomic here: nothing to do

    def remove_temps(self, path: str, *, stale_only: bool = True) -> list[str]:
        with self.mutex:
            gone = [s for s in self.pending.values() if s.name == path and (s.process in self.gone or not stale_only)]
            for sink in gone:
                del self.pending[sink.id]
        return [f"{s.name}#{s.id}" for s in gone]

    def unfinished(self, folder: str) -> list[str]:
        prefix = folder.rstrip("/") + "/"
        with self.mutex:
            names = {s.name[len(prefix) :] for s in self.pending.values() if s.name.startswith(prefix)}
        return sorted(n for n in names if "/" not in n)

    def lock(self, path: str, holder: bytes) -> MemLock:
        """A lock object holding the holder's bytes, as an object store keeps one; a lock of a
        process that crashed (``restart``) is free, as the kernel frees a dead process's."""
        self.count("lock")
        with self.mutex:
            held = self.locks.get(path)
            if held is not None and held.process not in self.gone:
                raise LockHeldError(path, self.objects.get(path, b""))
            lock = self.locks[path] = MemLock(self, path)
            self.objects[path] = holder
        return lock

    def read_small(self, path: str, limit: int) -> bytes:
        with self.open(path) as source:
            if source.size() > limit:
                raise OSError(errno.EFBIG, f"holds more than {limit} bytes", path)
            return source.data

    def _is_folder(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return path.rstrip("/") in self.folders or any(n.startswith(prefix) for n in self.objects)


class MemLock(Lock):
    """A writer lock of a ``MemStorage``: its object lives while the lock is held."""

    def __init__(self, store: MemStorage, name: str) -> None:
        self.store, self.name, self.process = store, name, store.process

    def close(self) -> None:
        with self.store.mutex:
            if self.store.locks.get(self.name) is self:
                del self.store.locks[self.name]
                self.store.objects.pop(self.name, None)


class MemSink(Sink):
    """An unpublished object: bytes written at offsets, visible only once published."""

    def __init__(self, store: MemStorage, name: str, id_: int) -> None:
        self.store, self.name, self.id = store, name, id_
        self.data = bytearray()
        self.writes: list[tuple[int, int]] = []  # (offset, length) of every write, in order
        self.state: Literal["open", "published", "abandoned"] = "open"
        self.process = store.process
        self._lock = threading.Lock()

    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        return self.store.grid  # no direct I/O here: direct_io changes nothing

    def write_at(self, view: memoryview, offset: int) -> None:
        if self.store.dead:
            raise Crash("the process is gone")
        self.store.step("write", self.name)
        with self._lock:
            end = offset + len(view)
            if end > len(self.data):
                self.data.extend(bytes(end - len(self.data)))
            self.data[offset:end] = view
            self.writes.append((offset, len(view)))

    def publish(self) -> None:
        if self.state == "published":
            return
        if self.state == "abandoned":
            raise ValueError(f"{self.name}: abandoned; it cannot be published")
        try:
            self.store.step("publish", self.name)
        except Crash:
            raise
        except BaseException:
            self.abandon()
            raise
        with self.store.mutex:
            self.store.objects[self.name] = bytes(self.data)
            self.store.pending.pop(self.id, None)
        self.state = "published"

    def abandon(self) -> None:
        if self.state != "open" or self.store.dead:
            return  # a dead process abandons nothing: its upload stays pending
        self.state = "abandoned"
        with self.store.mutex:
            self.store.pending.pop(self.id, None)

    def close(self) -> None:
        pass


class MemSource(Source):
    """An object as it was when opened (a later publish replaces the name, not these bytes)."""

    def __init__(self, store: MemStorage, name: str, data: bytes) -> None:
        self.store, self.name, self.data = store, name, data
        self.closed = 0  # times close was called

    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        return 1

    def size(self) -> int:
        return len(self.data)

    def read_into(self, view: memoryview, offset: int) -> int:
        self.store.step("read", self.name)
        with self.store.mutex:
            self.store.reads.append((offset, len(view)))
        end = len(self.data) if self.store.faults.reads_end_at is None else self.store.faults.reads_end_at
        n = max(0, min(len(view), end - offset))
        view[:n] = memoryview(self.data)[offset : offset + n]
        return n

    def close(self) -> None:
        self.closed += 1

