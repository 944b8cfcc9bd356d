"""The in-memory storage of the tests shared by processes (the ranks of a DCP job): its objects
and folders live in dicts served by the test process (``multiprocessing.managers``) on
127.0.0.1; each rank serves ``mem://`` URLs with a ``SharedMemStorage`` over them. A sink's
unpublished bytes stay in the process that writes them, as an upload's parts stay with its
writer until it completes."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from multiprocessing.managers import DictProxy, SyncManager
from typing import Any

from tests.memstore import MemStorage


class _Manager(SyncManager):  # its Iterator type serves the dicts' iteration
    pass


class _SharedSet:
    """A set kept as the keys of a shared dict (what MemStorage does with its folders)."""

    def __init__(self, keys: Any) -> None:
        self.keys = keys

    def add(self, name: str) -> None:
        self.keys[name] = 1

    def discard(self, name: str) -> None:
        self.keys.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self.keys

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.keys.keys()))


class SharedMemStorage(MemStorage):
    def __init__(self, objects: Any, folders: Any) -> None:
        self._shared: _SharedSet | None = None
        super().__init__()
        self.objects = objects
        self._shared = _SharedSet(folders)

    @property
    def folders(self) -> Any:
        return self._shared

    @folders.setter
    def folders(self, names: set[str]) -> None:
        if self._shared is None:  # MemStorage.__init__'s empty set
            return
        for name in list(self._shared):
            if name not in names:
                self._shared.discard(name)
        for name in names:
            self._shared.add(name)


class Server:
    """The shared dicts, served from a thread of this process; ``address`` and ``key`` reach them."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.folders: dict[str, int] = {}
        self.key = secrets.token_bytes(16)
        manager = _Manager(address=("127.0.0.1", 0), authkey=self.key)
        manager.register("objects", callable=lambda: self.objects, proxytype=DictProxy)
        manager.register("folders", callable=lambda: self.folders, proxytype=DictProxy)
        self._server = manager.get_server()
        self.address: tuple[str, int] = self._server.address  # type: ignore[assignment]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(SystemExit):  # how serve_forever ends once stopped
            self._server.serve_forever()

    def stop(self) -> None:
        self._server.stop_event.set()  # type: ignore[attr-defined]


def connect(host: str, port: int, key: bytes) -> SharedMemStorage:
    """In a rank: the storage over the test process's dicts."""
    _Manager.register("objects", proxytype=DictProxy)
    _Manager.register("folders", proxytype=DictProxy)
    manager = _Manager(address=(host, port), authkey=key)
    manager.connect()
    return SharedMemStorage(manager.objects(), manager.folders())  # type: ignore[attr-defined]
