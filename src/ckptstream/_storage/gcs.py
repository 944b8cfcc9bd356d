"""Google Cloud Storage as a storage: ``gs://bucket/key`` URLs, the GCS adapter of the
object-store layer (``objstore``, ``objsource``, ``objupload`` over ``objclient``'s protocol).

An upload is parts written as objects of their own under a hidden prefix of the bucket
(``.ckptstream-uploads/KEY/UPLOAD/NNNNN``), then composed into the key by one ``compose``
(a tree of them past 32 parts, GCS's limit per request) and removed: the key changes only when
the compose answers, whole. GCS's XML multipart upload API would do the same in fewer requests,
but the emulator the tests run on (gcp-storage-emulator) serves the JSON API only. Each part is
sent with its CRC-32C, which the store checks; the composed object's CRC-32C is compared with
the one of its parts combined. A killed save's parts are removed by the next save of the key.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from .. import _checksum
from .._errors import ObjectStoreError
from . import gcsclient, s3deadline
from .objclient import Answer, Head, MiB, ObjectUrl, Page, Upload, body_reader, crc_b64, failed_deletions, total_of
from .objstore import ObjectStorage

HIDDEN = ".ckptstream-uploads/"  # where the parts of uploads in flight lie
COMPOSE_MAX = 32  # sources per compose request (GCS's limit)


class GCSClient:
    """``objclient.ObjectClient`` over one ``google.cloud.storage.Client``."""

    name = "GCS"
    min_part, max_part, max_parts = 5 * MiB, 5 << 30, 10_000  # as S3's (compose itself has no minimum)
    page = 1000  # objects per listing page (GCS's most)
    delete_batch = 100  # deletions per batch request (GCS's limit)
    attempts = 6
    words = gcsclient.WORDS
    error = staticmethod(gcsclient.error)

    def __init__(self, gcs: Any, timeout: float) -> None:
        from google.cloud.storage.retry import DEFAULT_RETRY, _should_retry

        self.gcs, self.timeout, self.endpoint = gcs, timeout, str(gcs.api_endpoint)
        # the library's retries, none begun past the operation's deadline
        self.retry = DEFAULT_RETRY.with_predicate(lambda e: _should_retry(e) and not s3deadline.passed())

    def head(self, url: ObjectUrl) -> Head:
        blob = self._bucket(url).get_blob(url.key, timeout=self.timeout, retry=self.retry)
        if blob is None:
            from google.api_core.exceptions import NotFound

            raise NotFound(f"no such object: {url}")
        return Head(int(blob.size), str(blob.generation))

    def check_bucket(self, url: ObjectUrl) -> None:
        self.gcs.get_bucket(url.bucket, timeout=self.timeout, retry=self.retry)

    def get(self, url: ObjectUrl, lo: int, hi: int, etag: str | None) -> Answer:
        params = {"alt": "media", **({"ifGenerationMatch": etag} if etag else {})}
        response = self._send("GET", self._media(url), params=params, stream=True,
                              headers={"Range": f"bytes={lo}-{hi - 1}", "Accept-Encoding": "identity"})
        readinto, done = body_reader(response.raw, response.close)
        return Answer(int(response.headers.get("Content-Length", 0)), total_of(response.headers.get("Content-Range")),
                      response.headers.get("x-goog-generation"), readinto, done)

    def get_whole(self, url: ObjectUrl) -> tuple[int, Callable[[], bytes], Callable[[], None]]:
        response = self._send("GET", self._media(url), params={"alt": "media"}, stream=True,
                              headers={"Accept-Encoding": "identity"})
        return int(response.headers.get("Content-Length", 0)), response.raw.read, response.close

    def put(self, url: ObjectUrl, data: memoryview, crc: int) -> None:
        self._upload(url, url.key, data, crc)

    def list_page(self, url: ObjectUrl, prefix: str, *, delimiter: bool, limit: int, token: Any) -> Page:
        keys: list[str] = []
        prefixes: list[str] = []
        while True:  # pages that held only the hidden prefix are passed over
            blobs = self.gcs.list_blobs(url.bucket, prefix=prefix or None, delimiter="/" if delimiter else None,
                                        page_size=limit, page_token=token, timeout=self.timeout, retry=self.retry)
            page = next(blobs.pages)  # (a listing's bare 404 is a missing bucket: call's missing_is_bucket)
            keys += [b.name for b in page if not b.name.startswith(HIDDEN)]
            prefixes += [p for p in page.prefixes if not p.startswith(HIDDEN)]
            token = blobs.next_page_token
            if keys or prefixes or not token or not HIDDEN.startswith(prefix):
                return Page(keys, sorted(prefixes), token or None)

    def delete(self, url: ObjectUrl) -> None:
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):  # as S3: deleting what is gone is no failure
            self._bucket(url).delete_blob(url.key, timeout=self.timeout, retry=self.retry)

    def delete_many(self, url: ObjectUrl, keys: Sequence[str]) -> list[tuple[str, str, str]]:
        if not keys:
            return []
        bucket = self._bucket(url)
        batch = self.gcs.batch(raise_exception=False)  # one request for up to 100 deletions
        with batch:
            for key in keys:
                bucket.delete_blob(key, timeout=self.timeout)
        return failed_deletions(keys, getattr(batch, "_responses", ()))  # the library keeps each answer there

    def create_upload(self, url: ObjectUrl) -> str:
        import secrets

        return f"{time.time_ns() // 1000}-{secrets.token_hex(6)}"  # its start (in microseconds) first

    def upload_part(self, url: ObjectUrl, upload_id: str, number: int, data: memoryview, crc: int) -> str:
        generation = self._upload(url, _part(url.key, upload_id, f"{number:05d}"), data, crc, part=True)
        return f"{generation}/{len(data)}"  # what the compose needs of it: its version and size

    def complete_upload(self, url: ObjectUrl, upload_id: str, parts: list[tuple[int, str, int]]) -> None:
        bucket = self._bucket(url)
        level = []
        for number, tag, crc in parts:
            generation, size = tag.split("/")
            level.append((bucket.blob(_part(url.key, upload_id, f"{number:05d}"), generation=int(generation)), crc,
                          int(size)))
        depth = 0
        while len(level) > COMPOSE_MAX:  # 32 sources per compose: a tree of intermediate objects
            depth += 1
            groups = [level[at : at + COMPOSE_MAX] for at in range(0, len(level), COMPOSE_MAX)]
            level = [self._compose(bucket.blob(_part(url.key, upload_id, f"c{depth}-{i:05d}")), group)
                     for i, group in enumerate(groups)]
        self._compose(bucket.blob(url.key), level, final=True)
        with contextlib.suppress(Exception):  # the object is whole: parts left are removed by a later save
            self.abort_upload(url, upload_id)

    def _compose(self, dest: Any, sources: list[tuple[Any, int, int]], *, final: bool = False) -> tuple[Any, int, int]:
        crc, size = 0, 0
        for _, part_crc, part_size in sources:
            crc, size = _checksum.combine(crc, part_crc, part_size), size + part_size
        dest.crc32c = crc_b64(crc)  # checked by a store that checks it (the emulator does)
        dest.content_type = "application/octet-stream"
        dest.compose([s for s, _, _ in sources], timeout=self.timeout + size / s3deadline.limits().min_rate,
                     retry=self.retry)
        if dest.crc32c != crc_b64(crc):
            if final:
                with contextlib.suppress(Exception):
                    dest.delete(timeout=self.timeout)
            raise ObjectStoreError(f"gs://{dest.bucket.name}/{dest.name}", f"the composed object's CRC-32C is "
                                   f"{dest.crc32c}, its parts' {crc_b64(crc)}: the store corrupted it")
        return dest, crc, size

    def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        prefix = _part(url.key, upload_id, "")
        keys = [b.name for b in self.gcs.list_blobs(url.bucket, prefix=prefix, timeout=self.timeout, retry=self.retry)]
        for at in range(0, len(keys), self.delete_batch):
            self.delete_many(url, keys[at : at + self.delete_batch])

    def list_uploads(self, url: ObjectUrl, prefix: str, *, limit: int, token: Any) -> tuple[list[Upload], Any]:
        found: dict[tuple[str, str], Upload] = {}
        for blob in self.gcs.list_blobs(url.bucket, prefix=HIDDEN + prefix, timeout=self.timeout, retry=self.retry):
            key, upload_id, _ = blob.name[len(HIDDEN) :].rsplit("/", 2)
            micros = upload_id.partition("-")[0]
            seconds = int(micros) / 1e6 if micros.isdigit() else 0
            started = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
            found.setdefault((key, upload_id), Upload(key, upload_id, started))
        return list(found.values()), None

    def touched(self, url: ObjectUrl, upload: Upload) -> datetime.datetime:
        blobs = self.gcs.list_blobs(url.bucket, prefix=_part(upload.key, upload.upload_id, ""), timeout=self.timeout,
                                    retry=self.retry)
        last: datetime.datetime = max([upload.started, *(b.updated for b in blobs if b.updated)])
        return last

    # --- requests of the JSON API the library has no call for ------------------------------

    def _upload(self, url: ObjectUrl, key: str, data: memoryview, crc: int, *, part: bool = False) -> str:
        """``data`` sent from memory (no copy) to ``key``, its CRC-32C for the store to check; the
        new object's generation. A part is one request (X-Goog-Hash); anything else a resumable
        upload, whose first request carries the CRC-32C, checked before the object appears (the
        emulator checks it there, not in X-Goog-Hash). Either answer's CRC-32C is checked too."""
        expected, base = crc_b64(crc), f"{self.endpoint}/upload/storage/v1/b/{_quote(url.bucket)}/o"
        octets = {"Content-Type": "application/octet-stream"}

        def attempt() -> Any:
            if part:
                return self._send("POST", base, params={"uploadType": "media", "name": key}, data=data,
                                  headers={**octets, "X-Goog-Hash": f"crc32c={expected}"}, retry=False)
            start = self._send("POST", base, params={"uploadType": "resumable"}, json={"name": key, "crc32c": expected},
                               headers={"X-Upload-Content-Type": octets["Content-Type"]}, retry=False)
            return self._send("PUT", start.headers["Location"], data=data, headers=octets, retry=False)

        answer = self.retry(attempt)().json()  # an object is written whole, again if need be
        if answer.get("crc32c") != expected:  # (a part's object is hidden: the upload's abort removes it)
            raise ObjectStoreError(f"gs://{url.bucket}/{key}", f"the store holds CRC-32C {answer.get('crc32c')} "
                                   f"for bytes sent with {expected}: they changed on the way")
        return str(answer["generation"])

    def _send(self, method: str, url: str, *, retry: bool = True, **kwargs: Any) -> Any:
        def attempt() -> Any:
            s3deadline.refuse_past_deadline()
            return gcsclient.check(self.gcs._http.request(method, url, timeout=self.timeout, **kwargs))
        return self.retry(attempt)() if retry else attempt()

    def _media(self, url: ObjectUrl) -> str:
        return f"{self.endpoint}/download/storage/v1/b/{_quote(url.bucket)}/o/{_quote(url.key)}"

    def _bucket(self, url: ObjectUrl) -> Any:
        return self.gcs.bucket(url.bucket)


def _part(key: str, upload_id: str, name: str) -> str:
    return f"{HIDDEN}{key}/{upload_id}/{name}"


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class GCSStorage(ObjectStorage):
    """``gs://bucket/key`` URLs on the endpoint and with the credentials Google's client finds
    (or those ``options``, ``google.cloud.storage.Client``'s keyword arguments, give)."""

    def __init__(self, scheme: str = "gs", **options: Any) -> None:
        import google.cloud.storage  # noqa: F401  (made at the first gs:// URL: without it, that URL says what to install)

        super().__init__(scheme, options)

    def make_client(self, timeout: float) -> GCSClient:
        """A client over this storage's one library client (made with its first: its requests
        take their timeout each), forgotten with them by ``reset_client``."""
        made = next(iter(self._clients.values()), None)
        return GCSClient(made.gcs if isinstance(made, GCSClient) else gcsclient.make_client(self._options), timeout)


def reset_clients() -> None:
    """Every GCS storage's ``reset_client`` (Google's configuration changed)."""
    GCSStorage.reset_all()
