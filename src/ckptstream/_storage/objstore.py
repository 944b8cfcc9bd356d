"""An object store as a storage, through any ``ObjectClient``: ``scheme://bucket/key`` URLs.

Folders are key prefixes ending in "/": making one is a no-op, and one exists while an object
lies under it. Objects are written as multipart uploads (``objupload``) and read with ranged
GETs (``objsource``). Every failed request raises a typed error naming the URL (the client's
``error``), and every request ends within its deadline (``s3deadline``). An adapter (``s3``,
``gcs``, ``azure``) gives the scheme and makes the clients (``make_client``) of each storage's
options: several endpoints work in one process.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import errno
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .._errors import ObjectNotFoundError, ObjectStoreError
from . import s3deadline, s3journal
from .base import Entry, Kind, Lock, Storage
from .objclient import ObjectClient, ObjectUrl, Page, Upload, call, parse
from .objsource import ObjectSource, head_of
from .objupload import MultipartSink
from .s3record import WriterRecord

# an upload untouched for this long is aborted by the next writer of its key, whoever started it
# (a live writer uploads a part at least every few minutes); as local temps
STALE_AFTER = datetime.timedelta(hours=24)


_storages: weakref.WeakSet[ObjectStorage] = weakref.WeakSet()


class ObjectStorage(Storage):
    """``scheme://bucket/key`` URLs of one store (an endpoint and its credentials), reached with
    clients an adapter makes of its ``options`` (``make_client``): one per ``s3_timeout`` in
    force, its sockets' timeout, so that two storages reach two endpoints in one process."""

    def __init__(self, scheme: str, options: dict[str, Any]) -> None:
        self.scheme, self._options = scheme.lower(), options
        self._lock = threading.Lock()
        self._clients: dict[float, ObjectClient] = {}
        _storages.add(self)

    @abc.abstractmethod
    def make_client(self, timeout: float) -> ObjectClient:
        """A client of this storage's configuration whose sockets time out after ``timeout``
        seconds (called under the storage's lock)."""

    def client(self) -> ObjectClient:
        """The client for the settings in force in this thread (their s3_timeout), bound to this
        storage's endpoint; sources and sinks keep the one they were made with. Each is made once,
        under a lock (the libraries' clients are thread-safe, their sessions not all)."""
        timeout = s3deadline.limits().timeout
        with self._lock:
            if timeout not in self._clients:
                self._clients[timeout] = self.make_client(timeout)
            return self._clients[timeout]

    def reset_client(self) -> None:
        """Forget the clients: the next request makes one from the configuration as it is then."""
        with self._lock:
            self._clients.clear()

    @classmethod
    def reset_all(cls) -> None:
        """Every storage of this class's ``reset_client`` (the store's configuration changed)."""
        for storage in list(_storages):
            if isinstance(storage, cls):
                storage.reset_client()

    def open(self, path: str) -> ObjectSource:
        url = self._object(path)
        try:
            return ObjectSource(url, self.client())
        except ObjectNotFoundError:
            if self._has_children(url):
                raise IsADirectoryError(errno.EISDIR, "is a folder (a prefix of objects); give the URL of an object",
                                        path) from None
            raise

    def create(self, path: str) -> MultipartSink:
        url = self._object(path)
        self.check_target(path)
        self.remove_temps(path)
        return MultipartSink(url, self.client())

    def check_target(self, path: str) -> str:
        """The URL, once its key is not a folder (a prefix objects lie under, as the manager's
        step folders are): one LIST, whose answer also says where the bucket is missing or the
        credentials are refused."""
        url = self._object(path)
        if self._has_children(url):
            raise IsADirectoryError(errno.EISDIR, "is a folder (a prefix of objects); give the URL of an object in it",
                                    path)
        return str(url)

    def size(self, path: str) -> int:
        return head_of(self.client(), self._object(path), "looking at the object").size

    def exists(self, path: str) -> bool:
        return self.kind(path) is not None

    def kind(self, path: str) -> Kind | None:
        """"file" for an object (one HEAD), else "folder" where objects lie under the prefix (one
        LIST), else None: a folder made and left empty is none here."""
        url = self._parse(path)
        if url.key and not url.key.endswith("/"):
            try:
                head_of(self.client(), url, "looking at the object")
                return "file"
            except ObjectNotFoundError:
                pass
        return "folder" if self._has_children(url) else None

    def list_folder(self, folder: str) -> list[Entry]:
        url = self._parse(folder)
        prefix = _prefix(url.key)
        entries = []
        for page in self._pages(url, "listing the folder", prefix, delimiter=True):
            entries += [Entry(k[len(prefix) :], "file") for k in page.keys if k != prefix]
            entries += [Entry(p[len(prefix) :].rstrip("/"), "folder") for p in page.prefixes]
        # a prefix nothing lies under lists empty: a store cannot tell a folder made and left empty
        # (make_folders makes nothing) from none, and callers make folders before they list them
        return sorted(entries, key=lambda e: e.name)

    def remove(self, path: str, *, missing_ok: bool = False) -> None:
        url = self._object(path)
        client = self.client()
        if not missing_ok:
            head_of(client, url, "looking at the object to remove")  # stores delete a missing key without a word
        call(client, url, "removing the object", client.delete, url)

    def remove_tree(self, folder: str) -> None:
        """Every object under the prefix, and every upload still open under it."""
        url = self._parse(folder)
        prefix = _prefix(url.key)
        client = self.client()
        keys = [k for page in self._pages(url, "listing the folder to remove", prefix, delimiter=False)
                for k in page.keys]
        for i in range(0, len(keys), client.delete_batch):
            batch = keys[i : i + client.delete_batch]
            failed = call(client, url, f"removing {len(batch)} objects", client.delete_many, url, batch)
            if failed:
                key, code, message = failed[0]
                raise ObjectStoreError(str(url.child(key or prefix)), f"removing the folder failed for "
                                       f"{len(failed)} objects ({code}: {message})")
        for upload in self._uploads(url.child(prefix), exact=False):
            with contextlib.suppress(Exception):
                at = url.child(upload.key)
                call(client, at, "aborting an incomplete upload", client.abort_upload, at, upload.upload_id)
                s3journal.forget(url.bucket, upload.key, upload.upload_id)

    def remove_folder(self, folder: str) -> None:
        """Nothing to remove (a prefix is no object), once nothing lies under it."""
        if self._has_children(self._parse(folder)):
            raise OSError(errno.ENOTEMPTY, "objects lie under the folder (a prefix); they stay", folder)

    def make_folders(self, folder: str) -> None:
        self._parse(folder)  # a prefix exists while objects lie under it: nothing to make

    def sync_folder(self, folder: str) -> None:
        pass  # a completed upload, a PUT or a DELETE is durable once answered

    def remove_temps(self, path: str, *, stale_only: bool = True) -> list[str]:
        """Abort the incomplete uploads of the key: with ``stale_only``, those whose writers were on
        this host and are gone (the journal), or untouched for STALE_AFTER, and never this
        process's uploads in flight; without, every one (the caller knows no writer is left, as
        the local storage's temps go). The notes of gone writers whose uploads are no
        longer listed go too. Returns the upload ids aborted; never raises."""
        try:
            url = self._object(path)
            client = self.client()
            uploads = list(self._uploads(url, exact=True))
            # this process's uploads in flight are asked for once the journal is read (see
            # dead_writers): one begun meanwhile is either live by then or not yet noted as dead
            dead = s3journal.dead_writers(url.bucket, url.key, MultipartSink.live_uploads)
            live = MultipartSink.live_uploads()
            now = datetime.datetime.now(datetime.timezone.utc)
            removed = []
            for upload in uploads:
                upload_id = upload.upload_id
                if stale_only and upload_id in live:
                    continue
                if stale_only and upload_id not in dead and now - self._touched(client, url, upload) < STALE_AFTER:
                    continue
                with contextlib.suppress(Exception):
                    call(client, url, "aborting an incomplete upload", client.abort_upload, url, upload_id)
                    removed.append(upload_id)
                s3journal.forget(url.bucket, url.key, upload_id)
            # notes of gone writers whose uploads are gone too (aborted by another host, a
            # lifecycle rule, or a folder's removal): nothing is left for them to tell
            for upload_id in dead - {u.upload_id for u in uploads}:
                s3journal.forget(url.bucket, url.key, upload_id)
            return removed
        except Exception:
            return []

    def unfinished(self, folder: str) -> list[str]:
        """The names directly under the prefix with incomplete uploads (one LIST of uploads)."""
        try:
            url = self._parse(folder)
            prefix = _prefix(url.key)
            keys = {u.key[len(prefix) :] for u in self._uploads(url.child(prefix), exact=False)}
        except Exception:
            return []
        return sorted(k for k in keys if k and "/" not in k)

    def lock(self, path: str, holder: bytes) -> Lock:
        """A writer record, not a lock: object stores have none that its holder's death releases
        (a lock object that a killed writer left would refuse every later writer until someone
        removed it by hand). The record names the newest writer: taking it replaces the one
        there, and the writer it named learns so at its next ``check``."""
        return WriterRecord(self, str(self._object(path)), holder)

    def read_small(self, path: str, limit: int) -> bytes:
        url = self._object(path)
        client = self.client()
        what = "reading the object"
        with s3deadline.Deadline(url, what, limit):
            size, read, close = call(client, url, what, client.get_whole, url)
            try:
                if size > limit:
                    raise OSError(errno.EFBIG, f"holds {size} bytes, more than the {limit} expected of it", path)
                try:
                    data: bytes = read()
                except Exception as e:
                    raise client.error(e, url, what) from e
            finally:
                close()
        return data

    def write_small(self, path: str, data: bytes) -> None:
        """One PUT: a new object is visible whole or not at all."""
        with MultipartSink(self._object(path), self.client()) as sink:
            sink.write_at(memoryview(data), 0)

    # --- helpers --------------------------------------------------------------------------

    def _parse(self, path: str) -> ObjectUrl:
        return parse(path, self.scheme)

    def _object(self, path: str) -> ObjectUrl:
        url = self._parse(path)
        if not url.key or url.key.endswith("/"):
            raise IsADirectoryError(errno.EISDIR, "names a folder (a prefix); give the URL of an object "
                                    f"({self.scheme}://bucket/key)", path)
        return url

    def _has_children(self, url: ObjectUrl) -> bool:
        page = next(self._pages(url, "listing the folder", _prefix(url.key), delimiter=False, page_size=1), None)
        return bool(page and (page.keys or page.prefixes))

    def _pages(self, url: ObjectUrl, what: str, prefix: str, *, delimiter: bool,
               page_size: int | None = None) -> Iterator[Page]:
        """The listing's pages, each of the client's page of keys at most; with ``page_size``,
        only the first page, of that many."""
        client = self.client()
        token = None
        while True:
            page: Page = call(client, url, what, lambda t=token: client.list_page(
                url, prefix, delimiter=delimiter, limit=page_size or client.page, token=t), missing_is_bucket=True)
            yield page
            token = page.token
            if token is None or page_size:
                return

    def _uploads(self, url: ObjectUrl, *, exact: bool) -> Iterator[Upload]:
        """The incomplete uploads of the key (``exact``), or of every key under the prefix."""
        client = self.client()
        token = None
        while True:
            uploads, token = call(client, url, "listing incomplete uploads", lambda t=token: client.list_uploads(
                url, url.key, limit=client.page, token=t))
            yield from (u for u in uploads if not exact or u.key == url.key)
            if token is None:
                return

    @staticmethod
    def _touched(client: ObjectClient, url: ObjectUrl, upload: Upload) -> datetime.datetime:
        """When the upload last changed: its newest part, or its start."""
        try:
            last: datetime.datetime = call(client, url, "listing an upload's parts", client.touched, url, upload)
            return last
        except Exception:
            return upload.started


def _prefix(key: str) -> str:
    return key if not key or key.endswith("/") else key + "/"
