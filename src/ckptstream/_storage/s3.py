"""S3-compatible object stores as a storage: ``s3://bucket/key`` URLs.

Objects are written as multipart uploads from the staging buffers (``s3upload``) and read with
ranged GETs, one per chunk, straight into the staging buffers, from as many threads as the
transfer has. Folders are key prefixes ending in "/": making one is a no-op, and one exists
while an object lies under it. Every failed request raises a typed error naming the URL
(``s3client``), and every request ends within its deadline (``s3deadline``).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import http.client
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import (
    BucketNotFoundError,
    ConnectionLostError,
    ObjectNotFoundError,
    ObjectReplacedError,
    ObjectStoreError,
)
from .._settings import DirectIO
from . import s3client, s3deadline, s3journal
from .base import Entry, Kind, Lock, Source, Storage
from .s3client import S3Url
from .s3record import WriterRecord
from .s3upload import MultipartSink

log = logging.getLogger(__name__)

# an upload untouched for this long is aborted by the next writer of its key, whoever started it
# (a live writer uploads a part at least every few minutes); as local temps
STALE_AFTER = datetime.timedelta(hours=24)
# bytes of an object fetched when it is opened, with its size and ETag: as many as a reader's
# first read (the header of most checkpoints), so that it needs no request of its own
FIRST = 1 << 20
_DELETE_BATCH = 1000  # keys per DeleteObjects request (S3's limit)
_LIST_PAGE = 1000  # keys per ListObjectsV2 page and uploads per ListMultipartUploads page (S3's most)


class S3Source(Source):
    """An object opened for reading. Opening is one ranged GET of the object's first bytes,
    which also gives its size and ETag: a reader's first read (the header) is then served from
    them, without a request of its own. Every later read asks for that version (If-Match) and
    checks the answer's ETag, so an object replaced meanwhile fails the read instead of mixing
    two versions, also where the store ignores If-Match."""

    def __init__(self, url: S3Url) -> None:
        self.url, self.name = url, str(url)
        self._client = s3client.client()
        self._limits = s3deadline.limits()  # the caller's: reads come from the transfer's threads
        self._first = b""  # the object's first bytes, until a read has used them up
        with s3deadline.Deadline(url, "opening the object", FIRST, self._limits) as deadline:
            self._size, self._etag = self._open(deadline)

    def _open(self, deadline: s3deadline.Deadline) -> tuple[int, str | None]:
        """The size and ETag, keeping the first bytes where they come whole; an empty object
        (which has no byte range to ask for) is looked at with a HEAD instead."""
        what = "opening the object"
        try:
            response = self._client.get_object(Bucket=self.url.bucket, Key=self.url.key, Range=f"bytes=0-{FIRST - 1}")
        except Exception as e:
            typed = s3client.error(e, self.url, what)
            if getattr(typed, "code", None) in ("InvalidRange", "416"):
                head = _head(self._client, self.url, what)
                return int(head["ContentLength"]), head.get("ETag") or None
            raise typed from e  # (a GET, unlike a HEAD, says NoSuchBucket where the bucket is missing)
        length = int(response["ContentLength"])
        whole = response.get("ContentRange", "").rpartition("/")[2]
        size = int(whole) if whole.isdigit() else length  # no range: the server sent the whole object
        body = response["Body"]
        readinto, done = _reader(body)
        # more than asked for: a server that ignores ranges (the reads will say so); take nothing
        first, got = bytearray(length if length <= FIRST else 0), 0
        try:
            view = memoryview(first)
            while got < len(first) and (n := readinto(view[got:])):
                got += n
        except Exception:
            pass  # a body broken midway: the reads ask again
        finally:
            done(got == length)
        if got < len(first):
            deadline.check()  # unless it stalled until the deadline: then the store is not answering
        if got == length <= FIRST:
            self._first = bytes(first)
        return size, response.get("ETag") or None

    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        if direct_io is DirectIO.ON:
            raise ValueError(f"{self.name}: direct_io='on' is for local files; an object store takes 'auto' or 'off'")
        return 1

    def size(self) -> int:
        return self._size

    def read_into(self, view: memoryview, offset: int) -> int:
        return self.readv_into([view], offset)

    def readv_into(self, views: Sequence[memoryview], offset: int) -> int:
        """One ranged GET for all of ``views``' bytes (those the object has), streamed into them
        in turn; bytes within those kept from the opening are copied from them instead."""
        want = min(sum(len(v) for v in views), max(0, self._size - offset))
        if want <= 0:
            return 0
        targets, left = [], want
        for view in views:
            if left <= 0:
                break
            if len(view):
                targets.append(view[:left])
                left -= len(targets[-1])
        first = self._first
        if offset + want <= len(first):
            at = offset
            for view in targets:
                view[:] = first[at : at + len(view)]
                at += len(view)
            if offset + want == len(first):
                self._first = b""  # read to their end (a reader's header): not needed again
            return want
        self._get(targets, offset, want)
        return want

    def _get(self, views: list[memoryview], offset: int, want: int) -> None:
        """Fill ``views`` (``want`` bytes in all) from ``offset``; a connection that breaks while
        the body streams is asked again for the rest (botocore retries only the request itself),
        a bounded number of times, all within one deadline."""
        with s3deadline.Deadline(self.url, f"reading bytes {offset}..{offset + want}", want, self._limits) as deadline:
            self._get_within(deadline, views, offset, want)

    def _get_within(self, deadline: s3deadline.Deadline, views: list[memoryview], offset: int, want: int) -> None:
        got, failures, at, into = 0, 0, 0, 0  # bytes done; the view being filled, and how far
        while got < want:
            if failures:
                deadline.check()  # a connection shut at the deadline is not asked again
            lo, hi = offset + got, offset + want
            what = f"reading bytes {lo}..{hi}"
            kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Key": self.url.key, "Range": f"bytes={lo}-{hi - 1}"}
            if self._etag is not None:
                kwargs["IfMatch"] = self._etag
            try:
                response = self._client.get_object(**kwargs)
                body = self._check_answer(response, what, hi - lo)
                readinto, done = _reader(body)
                try:
                    while got < want and (n := readinto(views[at][into:])):
                        got, into = got + n, into + n
                        if into == len(views[at]):
                            at, into = at + 1, 0
                finally:
                    done(got == want)
                if got == want:
                    return
                cause: Exception = ConnectionError(f"the body ended {hi - lo - (offset + got - lo)} bytes early")
            except ObjectStoreError:
                raise
            except Exception as e:
                typed = s3client.error(e, self.url, what)
                code = getattr(typed, "code", None)
                if code in ("PreconditionFailed", "412", "InvalidRange", "416"):
                    # not the ETag opened, or no longer the bytes asked for (all lie within the size opened)
                    raise ObjectReplacedError(self.name, f"{what}: the object was replaced while it was read "
                                              "(its ETag or size changed since it was opened); load it again",
                                              code) from e
                if not isinstance(typed, ConnectionLostError):
                    raise typed from e
                cause = e
            failures += 1
            log.debug("%s: %s broke (%s); asking again for the rest (%d of %d)", self.name, what, cause, failures,
                      s3client.DEFAULT_ATTEMPTS)
            if failures >= s3client.DEFAULT_ATTEMPTS:
                raise ConnectionLostError(self.name, f"{what}: the connection broke {failures} times while "
                                                   f"the body streamed ({cause})") from cause

    def _check_answer(self, response: dict[str, Any], what: str, length: int) -> Any:
        """The body of a ranged GET's answer, once it is of the opened object and of the range. A
        store that ignores If-Match (rclone does) answers with a replaced object's new bytes: its
        ETag or size tells them apart before they reach a tensor or its checksum
        (ObjectReplacedError)."""
        etag = response.get("ETag") or None
        whole = response.get("ContentRange", "").rpartition("/")[2]
        size = int(whole) if whole.isdigit() else self._size
        if size != self._size or (etag is not None and self._etag is not None and etag != self._etag):
            response["Body"].close()
            raise ObjectReplacedError(self.name, f"{what}: the object was replaced while it was read (opened: "
                                      f"{self._size} bytes, ETag {self._etag}; now: {size} bytes, ETag {etag}); "
                                      "open it again", "PreconditionFailed")
        if response["ContentLength"] != length:  # a server that ignored the range sent it all
            response["Body"].close()
            raise ObjectStoreError(self.name, f"{what}: the store answered {response['ContentLength']} "
                                   f"bytes, not {length}; it does not serve byte ranges")
        return response["Body"]

    def close(self) -> None:
        self._first = b""


class S3Storage(Storage):
    """``s3://bucket/key`` URLs on the endpoint the standard AWS configuration names."""

    def __init__(self) -> None:
        import boto3  # noqa: F401  (made at the first s3:// URL: without boto3, that URL says what to install)

    def open(self, path: str) -> S3Source:
        url = self._object(path)
        try:
            return S3Source(url)
        except ObjectNotFoundError:
            if self._has_children(url):
                raise IsADirectoryError(errno.EISDIR, "is a folder (a prefix of objects); give the URL of an object",
                                        path) from None
            raise

    def create(self, path: str) -> MultipartSink:
        url = self._object(path)
        self.check_target(path)
        self.remove_temps(path)
        return MultipartSink(url)

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
        url = self._object(path)
        return int(_head(s3client.client(), url, "looking at the object")["ContentLength"])

    def exists(self, path: str) -> bool:
        url = s3client.parse(path)
        if url.key and not url.key.endswith("/"):
            try:
                _head(s3client.client(), url, "looking at the object")
                return True
            except ObjectNotFoundError:
                pass
        return self._has_children(url)

    def kind(self, path: str) -> Kind | None:
        """"file" for an object (one HEAD), else "folder" where objects lie under the prefix (one
        LIST), else None: a folder made and left empty is none here."""
        url = s3client.parse(path)
        if url.key and not url.key.endswith("/"):
            try:
                _head(s3client.client(), url, "looking at the object")
                return "file"
            except ObjectNotFoundError:
                pass
        return "folder" if self._has_children(url) else None

    def list_folder(self, folder: str) -> list[Entry]:
        url = s3client.parse(folder)
        prefix = _prefix(url.key)
        entries = []
        for page in self._pages(url, "listing the folder", Prefix=prefix, Delimiter="/"):
            entries += [Entry(o["Key"][len(prefix) :], "file") for o in page.get("Contents", ())
                        if o["Key"] != prefix]
            entries += [Entry(p["Prefix"][len(prefix) :].rstrip("/"), "folder") for p in page.get("CommonPrefixes", ())]
        # a prefix nothing lies under lists empty: a store cannot tell a folder made and left empty
        # (make_folders makes nothing) from none, and callers make folders before they list them
        return sorted(entries, key=lambda e: e.name)

    def remove(self, path: str, *, missing_ok: bool = False) -> None:
        url = self._object(path)
        client = s3client.client()
        if not missing_ok:
            _head(client, url, "looking at the object to remove")  # S3 deletes a missing key without a word
        s3client.request(url, "removing the object", client.delete_object, Bucket=url.bucket, Key=url.key)

    def remove_tree(self, folder: str) -> None:
        """Every object under the prefix, and every upload still open under it."""
        url = s3client.parse(folder)
        prefix = _prefix(url.key)
        client = s3client.client()
        keys = [o["Key"] for page in self._pages(url, "listing the folder to remove", Prefix=prefix)
                for o in page.get("Contents", ())]
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + _DELETE_BATCH]]
            answer = s3client.request(url, f"removing {len(batch)} objects", client.delete_objects, Bucket=url.bucket,
                                      Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise ObjectStoreError(str(url.child(first.get("Key", prefix))), f"removing the folder failed for "
                                       f"{len(answer['Errors'])} objects ({first.get('Code')}: {first.get('Message')})")
        for upload in self._uploads(url.child(prefix), exact=False):
            with contextlib.suppress(Exception):
                s3client.request(url.child(upload["Key"]), "aborting an incomplete upload",
                                 client.abort_multipart_upload, Bucket=url.bucket, Key=upload["Key"],
                                 UploadId=upload["UploadId"])
                s3journal.forget(url.bucket, upload["Key"], upload["UploadId"])

    def remove_folder(self, folder: str) -> None:
        """Nothing to remove (a prefix is no object), once nothing lies under it."""
        if self._has_children(s3client.parse(folder)):
            raise OSError(errno.ENOTEMPTY, "objects lie under the folder (a prefix); they stay", folder)

    def make_folders(self, folder: str) -> None:
        s3client.parse(folder)  # a prefix exists while objects lie under it: nothing to make

    def sync_folder(self, folder: str) -> None:
        pass  # a completed upload, a PUT or a DELETE is durable once answered

    def remove_temps(self, path: str, *, stale_only: bool = True) -> list[str]:
        """Abort the incomplete uploads of the key: with ``stale_only``, those whose writers were on
        this host and are gone (the journal), or untouched for STALE_AFTER; this process's
        uploads in flight are never touched. The notes of gone writers whose uploads are no
        longer listed go too. Returns the upload ids aborted; never raises."""
        try:
            url = self._object(path)
            client = s3client.client()
            uploads = list(self._uploads(url, exact=True))
            # this process's uploads in flight are asked for once the journal is read (see
            # dead_writers): one begun meanwhile is either live by then or not yet noted as dead
            dead = s3journal.dead_writers(url.bucket, url.key, MultipartSink.live_uploads)
            live = MultipartSink.live_uploads()
            now = datetime.datetime.now(datetime.timezone.utc)
            removed = []
            for upload in uploads:
                upload_id = upload["UploadId"]
                if upload_id in live:
                    continue
                if stale_only and upload_id not in dead and now - self._touched(client, url, upload) < STALE_AFTER:
                    continue
                with contextlib.suppress(Exception):
                    s3client.request(url, "aborting an incomplete upload", client.abort_multipart_upload,
                                     Bucket=url.bucket, Key=url.key, UploadId=upload_id)
                    removed.append(upload_id)
                s3journal.forget(url.bucket, url.key, upload_id)
            # notes of gone writers whose uploads are gone too (aborted by another host, a
            # lifecycle rule, or a folder's removal): nothing is left for them to tell
            for upload_id in dead - {u["UploadId"] for u in uploads}:
                s3journal.forget(url.bucket, url.key, upload_id)
            return removed
        except Exception:
            return []

    def unfinished(self, folder: str) -> list[str]:
        """The names directly under the prefix with incomplete uploads (one LIST of uploads)."""
        try:
            url = s3client.parse(folder)
            prefix = _prefix(url.key)
            keys = {u["Key"][len(prefix) :] for u in self._uploads(url.child(prefix), exact=False)}
        except Exception:
            return []
        return sorted(k for k in keys if k and "/" not in k)

    def lock(self, path: str, holder: bytes) -> Lock:
        """A writer record, not a lock: S3 has none that its holder's death releases (a lock
        object that a killed writer left would refuse every later writer until someone removed
        it by hand). The record names the newest writer: taking it replaces the one there, and
        the writer it named learns so at its next ``check``."""
        return WriterRecord(self, str(self._object(path)), holder)

    def read_small(self, path: str, limit: int) -> bytes:
        url = self._object(path)
        with s3deadline.Deadline(url, "reading the object", limit):
            return self._read_small(url, limit, path)

    @staticmethod
    def _read_small(url: S3Url, limit: int, path: str) -> bytes:
        response = s3client.request(url, "reading the object", s3client.client().get_object, Bucket=url.bucket,
                                    Key=url.key)
        body = response["Body"]
        try:
            if response["ContentLength"] > limit:
                raise OSError(errno.EFBIG, f"holds {response['ContentLength']} bytes, more than the {limit} expected "
                              "of it", path)
            try:
                data: bytes = body.read()
            except Exception as e:
                raise s3client.error(e, url, "reading the object") from e
        finally:
            body.close()
        return data

    def write_small(self, path: str, data: bytes) -> None:
        """One PUT: S3 makes a new object visible whole or not at all."""
        sink = MultipartSink(self._object(path))
        with sink:
            sink.write_at(memoryview(data), 0)

    # --- helpers --------------------------------------------------------------------------

    @staticmethod
    def _object(path: str) -> S3Url:
        url = s3client.parse(path)
        if not url.key or url.key.endswith("/"):
            raise IsADirectoryError(errno.EISDIR, "names a folder (a prefix); give the URL of an object "
                                    "(s3://bucket/key)", path)
        return url

    def _has_children(self, url: S3Url) -> bool:
        page = next(self._pages(url, "listing the folder", page_size=1, Prefix=_prefix(url.key)), {})
        return bool(page.get("KeyCount") or page.get("Contents") or page.get("CommonPrefixes"))

    @staticmethod
    def _pages(url: S3Url, what: str, *, page_size: int | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """The listing's pages, each of ``_LIST_PAGE`` keys at most; with ``page_size``, only the
        first page, of that many."""
        client = s3client.client()
        token: str | None = None
        while True:
            args = dict(kwargs, Bucket=url.bucket, MaxKeys=page_size or _LIST_PAGE,
                        **({"ContinuationToken": token} if token else {}))
            page: dict[str, Any] = s3client.request(url, what, client.list_objects_v2, **args)
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token or page_size:
                return

    @staticmethod
    def _uploads(url: S3Url, *, exact: bool) -> Iterator[dict[str, Any]]:
        """The incomplete uploads of the key (``exact``), or of every key under the prefix."""
        client = s3client.client()
        markers: dict[str, Any] = {}
        while True:
            try:
                page = s3client.request(url, "listing incomplete uploads", client.list_multipart_uploads,
                                        Bucket=url.bucket, Prefix=url.key, MaxUploads=_LIST_PAGE, **markers)
            except ObjectStoreError as e:
                if e.code == "NoSuchUpload":
                    return  # some servers answer so for a bucket that never had an upload
                raise
            yield from (u for u in page.get("Uploads", ()) if not exact or u["Key"] == url.key)
            if not page.get("IsTruncated"):
                return
            markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    @staticmethod
    def _touched(client: Any, url: S3Url, upload: dict[str, Any]) -> datetime.datetime:
        """When the upload last changed: its newest part, or its start."""
        last: datetime.datetime = upload["Initiated"]
        with contextlib.suppress(Exception):
            parts = s3client.request(url, "listing an upload's parts", client.list_parts, Bucket=url.bucket,
                                     Key=url.key, UploadId=upload["UploadId"]).get("Parts", ())
            last = max([last, *(p["LastModified"] for p in parts)])
        return last


def _reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[bool], None]]:
    """How to read a GET's body straight into a buffer, and how to let it go (given whether it
    was read to its end). http.client's own readinto fills the buffer in place; botocore's
    (through urllib3) reads a bytes object and copies it: the former where the layers under
    botocore are the ones known, the latter otherwise."""
    raw: Any = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse) and callable(getattr(raw, "release_conn", None)):

        def done(whole: bool) -> None:
            if whole and fp.isclosed():  # read to its Content-Length: the connection serves the next request
                raw.release_conn()
            else:
                body.close()

        return fp.readinto, done
    return body.readinto, lambda whole: body.close()


def _prefix(key: str) -> str:
    return key if not key or key.endswith("/") else key + "/"


def _head(client: Any, url: S3Url, what: str) -> dict[str, Any]:
    try:
        head: dict[str, Any] = s3client.request(url, what, client.head_object, Bucket=url.bucket, Key=url.key)
        return head
    except ObjectNotFoundError:
        check_bucket(client, url)  # HEAD answers a bare 404: a missing bucket is told apart
        raise


def check_bucket(client: Any, url: S3Url) -> None:
    """Raise the typed error of a bucket that cannot be used (missing, denied, unreachable)."""
    try:
        s3client.request(url, "looking at the bucket", client.head_bucket, Bucket=url.bucket)
    except ObjectNotFoundError as e:
        raise BucketNotFoundError(str(url), f"the bucket {url.bucket!r} does not exist; create it first, or check "
                                  "the URL and AWS_ENDPOINT_URL", "NoSuchBucket") from e
