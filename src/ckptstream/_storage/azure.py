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
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from . import azureclient
from .objclient import Answer, Head, MiB, ObjectUrl, Page, Upload, ViewBody, body_reader, failed_deletions, total_of
from .objstore import ObjectStorage

__all__ = ["AzureClient", "AzureStorage", "reset_clients"]

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
    words = azureclient.WORDS

    def __init__(self, make: Callable[[], Any]) -> None:
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
        response = stream.response.internal_response  # requests', streamed
        readinto, done = body_reader(response.raw, response.close)
        return Answer(int(headers["Content-Length"]), total_of(headers.get("Content-Range")),
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
        return failed_deletions(keys, answers, lambda a: str(a.headers.get("x-ms-error-code", a.status_code)))

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


class AzureStorage(ObjectStorage):
    """``scheme://container/key`` URLs (``az`` unless told) of the account Azure's variables
    name, or the one ``options`` give (``connection_string=``, or ``account_url=`` and
    ``credential=``: ``BlobServiceClient``'s)."""

    def __init__(self, scheme: str = "az", **options: Any) -> None:
        import azure.storage.blob  # noqa: F401  (made at the first az:// URL: without it, that URL says what to install)

        super().__init__(scheme, options)

    def make_client(self, timeout: float) -> AzureClient:
        return AzureClient(lambda: azureclient.make_client(timeout, self._options))


def reset_clients() -> None:
    """Every Azure storage's ``reset_client`` (Azure's variables changed)."""
    AzureStorage.reset_all()
