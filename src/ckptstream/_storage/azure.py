"""Azure Blob Storage as a storage: ``az://container/key`` URLs, the Azure adapter of the
object-store layer (``objstore``, ``objsource``, ``objupload`` over ``objclient``'s protocol).

A multipart upload is a block blob's staged blocks: each part is one Put Block (its MD5 checked
by the service), and completing the upload is one Put Block List naming this upload's blocks in
order, which makes the blob appear whole. Azure keeps no upload object: an upload id is made
here and leads each of its block ids, so a commit names only its own blocks. Blocks never
committed (a killed writer's) are discarded by the blob's next commit, or by Azure a week after
they were staged; there is nothing to list or abort until then.

Each ``AzureStorage`` makes its own clients (``azureclient``), one per ``s3_timeout`` in force,
from Azure's variables and its own options: two storages reach two accounts.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.client
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .objclient import Answer, Head, ObjectUrl, Page, Upload
from .objstore import ObjectStorage
from .s3 import ViewBody  # a memoryview as a file, sent (and rewound to retry) without a copy

__all__ = ["AzureClient", "AzureStorage", "reset_clients"]

MiB = 1 << 20
MIN_PART = 1 * MiB  # Azure has no least block size: this keeps the held-back head small
MAX_PART = 4000 * MiB  # a block's most (service version 2019-12-12 and later)
MAX_PARTS = 50_000  # committed blocks per blob
UNCOMMITTED_KEPT = datetime.timedelta(days=7)  # Azure discards blocks never committed after this


def block_id(upload_id: str, number: int) -> str:
    """The block id of a part: every id of a blob has the same length, as Azure requires."""
    return base64.b64encode(f"{upload_id}-{number:06d}".encode()).decode()


class AzureClient:
    """``objclient.ObjectClient`` over one ``BlobServiceClient``."""

    name = "Azure Blob Storage"
    min_part, max_part, max_parts = MIN_PART, MAX_PART, MAX_PARTS
    page = 5000  # blobs per List Blobs page (Azure's most)
    delete_batch = 256  # sub-requests per blob batch (Azure's limit)
    bucket_hint = "AZURE_STORAGE_CONNECTION_STRING"

    def __init__(self, make: Callable[[], Any]) -> None:
        from . import azureclient

        self._service, self._missing, self.endpoint = None, None, ""
        try:
            self._service = make()
            self.endpoint = str(self._service.url)
        except azureclient.MissingAccount as e:
            self._missing = e  # raised by each request, which names its URL (NoCredentialsError)
        self.attempts = azureclient.DEFAULT_ATTEMPTS
        self.error = azureclient.error

    @property
    def service(self) -> Any:
        """The ``BlobServiceClient``."""
        if self._missing is not None:
            raise self._missing
        return self._service

    def _blob(self, url: ObjectUrl) -> Any:
        return self.service.get_blob_client(url.bucket, url.key)

    def head(self, url: ObjectUrl) -> Head:
        props = self._blob(url).get_blob_properties()
        return Head(int(props.size), props.etag or None)

    def check_bucket(self, url: ObjectUrl) -> None:
        self.service.get_container_client(url.bucket).get_container_properties()

    def get(self, url: ObjectUrl, lo: int, hi: int, etag: str | None) -> Answer:
        # the generated operation, not download_blob: its downloader reads each answer whole into
        # memory, where this streams the body into the caller's buffer
        from azure.core.exceptions import HttpResponseError
        from azure.storage.blob._deserialize import deserialize_blob_stream
        from azure.storage.blob._generated.models import ModifiedAccessConditions
        from azure.storage.blob._shared.response_handlers import process_storage_error

        blob = self._blob(url)
        try:
            _, stream = blob._client.blob.download(
                range=f"bytes={lo}-{hi - 1}", modified_access_conditions=ModifiedAccessConditions(if_match=etag),
                cls=deserialize_blob_stream)
        except HttpResponseError as e:
            process_storage_error(e)  # the public API's typed error, with its error code
        headers = stream.response.headers
        whole = headers.get("Content-Range", "").rpartition("/")[2]
        readinto, done = _reader(stream.response.internal_response)
        return Answer(int(headers["Content-Length"]), int(whole) if whole.isdigit() else None,
                      headers.get("ETag") or None, readinto, done)

    def get_whole(self, url: ObjectUrl) -> tuple[int, Callable[[], bytes], Callable[[], None]]:
        downloader = self._blob(url).download_blob()
        return int(downloader.size), downloader.readall, lambda: None

    def put(self, url: ObjectUrl, data: memoryview, crc: int) -> None:
        self._blob(url).upload_blob(bytes(data), overwrite=True, validate_content="md5")  # one Put Blob

    def list_page(self, url: ObjectUrl, prefix: str, *, delimiter: bool, limit: int, token: Any) -> Page:
        container = self.service.get_container_client(url.bucket)
        listed = (container.walk_blobs(name_starts_with=prefix, delimiter="/", results_per_page=limit) if delimiter
                  else container.list_blobs(name_starts_with=prefix, results_per_page=limit))
        pages = listed.by_page(continuation_token=token)
        items = list(next(pages))
        keys = [i.name for i in items if not i.name.endswith("/") or not hasattr(i, "prefix")]
        prefixes = [i.name for i in items if i.name.endswith("/") and hasattr(i, "prefix")]
        return Page(keys, prefixes, pages.continuation_token or None)

    def delete(self, url: ObjectUrl) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self._blob(url).delete_blob(delete_snapshots="include")
        except ResourceNotFoundError as e:
            if getattr(e, "error_code", None) != "BlobNotFound":
                raise  # a missing blob is deleted, as S3 says; a missing container is not

    def delete_many(self, url: ObjectUrl, keys: Sequence[str]) -> list[tuple[str, str, str]]:
        container = self.service.get_container_client(url.bucket)
        answers = container.delete_blobs(*keys, delete_snapshots="include", raise_on_any_failure=False)
        failed = []
        for key, answer in zip(keys, answers, strict=True):
            if answer.status_code >= 300 and answer.status_code != 404:
                failed.append((key, str(answer.headers.get("x-ms-error-code", answer.status_code)),
                               str(answer.reason)))
        return failed

    def create_upload(self, url: ObjectUrl) -> str:
        return uuid.uuid4().hex[:20]  # no request: Azure has no upload object, only blocks

    def upload_part(self, url: ObjectUrl, upload_id: str, number: int, data: memoryview, crc: int) -> str:
        ident = block_id(upload_id, number)
        md5 = hashlib.md5(data, usedforsecurity=False).digest()  # the service refuses a block that differs
        self._blob(url).stage_block(ident, ViewBody(data), length=len(data), transactional_content_md5=md5)
        return ident

    def complete_upload(self, url: ObjectUrl, upload_id: str, parts: list[tuple[int, str, int]]) -> None:
        from azure.storage.blob import BlobBlock

        # only this upload's blocks, in order: any other uncommitted block of the blob is discarded
        self._blob(url).commit_block_list([BlobBlock(ident) for _, ident, _ in parts])

    def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        pass  # blocks cannot be removed: the blob's next commit, or Azure's expiry, discards them

    def list_uploads(self, url: ObjectUrl, prefix: str, *, limit: int, token: Any) -> tuple[list[Upload], Any]:
        return [], None  # no upload objects (see the module's docstring)

    def touched(self, url: ObjectUrl, upload: Upload) -> datetime.datetime:
        return upload.started


_storages: weakref.WeakSet[AzureStorage] = weakref.WeakSet()


class AzureStorage(ObjectStorage):
    """``scheme://container/key`` URLs (``az`` unless told) of the account Azure's variables
    name, or the one ``options`` give (``connection_string=``, or ``account_url=`` and
    ``credential=``: ``BlobServiceClient``'s)."""

    def __init__(self, scheme: str = "az", **options: Any) -> None:
        import azure.storage.blob  # noqa: F401  (made at the first az:// URL: without it, that URL says what to install)

        self.scheme, self._options = scheme.lower(), options
        self._lock = threading.Lock()
        self._clients: dict[float, AzureClient] = {}
        _storages.add(self)

    def client(self) -> AzureClient:
        """This storage's client for the ``s3_timeout`` in force, its sockets' timeout (made once,
        under a lock; azure-storage-blob's clients are thread-safe)."""
        from . import azureclient, s3deadline

        timeout = s3deadline.limits().timeout
        with self._lock:
            if timeout not in self._clients:
                self._clients[timeout] = AzureClient(lambda: azureclient.make_client(timeout, self._options))
            return self._clients[timeout]

    def reset_client(self) -> None:
        """Forget the clients: the next request makes one from the configuration as it is then."""
        with self._lock:
            self._clients.clear()


def reset_clients() -> None:
    """Every Azure storage's ``reset_client`` (Azure's variables changed)."""
    for storage in list(_storages):
        storage.reset_client()


def _reader(response: Any) -> tuple[Callable[[memoryview], int], Callable[[bool], None]]:
    """How to read a GET's body (a ``requests`` response, streamed) straight into a buffer, and
    how to let it go: http.client's readinto fills the buffer in place where urllib3's response
    wraps one, urllib3's own (a copy) otherwise."""
    raw = response.raw
    fp = getattr(raw, "_fp", None)

    def done(whole: bool) -> None:
        if whole and (not isinstance(fp, http.client.HTTPResponse) or fp.isclosed()):
            raw.release_conn()  # read to its end: the connection serves the next request
        else:
            response.close()

    if isinstance(fp, http.client.HTTPResponse) and not raw.headers.get("content-encoding"):
        return fp.readinto, done
    return raw.readinto, done
