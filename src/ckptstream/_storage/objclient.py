"""The client protocol under the object-store layer: what ``objstore`` (the namespace),
``objsource`` (ranged reads) and ``objupload`` (multipart writes) ask of one cloud's client.

An adapter (``s3``, ``gcs``, ``azure``) implements ``ObjectClient`` over its own library: each
method is one request, raising what the library raises; ``error`` turns that into ckptstream's
typed errors (``answer_error`` and ``lost_error`` word them alike for every store). The layer
above wraps every call in its deadline and its error mapping (``call``), so an adapter holds no
retry, deadline, pagination or part-numbering logic of its own. What the libraries share is
here once: a body read in place (``body_reader``), a memoryview sent as a file (``ViewBody``).

Error codes the layer acts on (an adapter's typed errors carry them in ``code``):
``REPLACED`` (the ETag asked for is no longer the object's) and ``EMPTY_RANGE`` (no bytes in
the range asked for: an empty object, or one replaced by a shorter one).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import http.client
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, Protocol

from .._errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CkptStreamError,
    ConnectionLostError,
    ObjectNotFoundError,
    ObjectStoreError,
    ThrottledError,
)
from . import s3deadline

MiB = 1 << 20
REPLACED = frozenset({"PreconditionFailed", "412"})
EMPTY_RANGE = frozenset({"InvalidRange", "416"})


@dataclasses.dataclass(frozen=True)
class ObjectUrl:
    """``scheme://bucket/key``: an object (or, with a key ending in "/" or empty, a prefix)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def child(self, key: str) -> ObjectUrl:
        return ObjectUrl(self.scheme, self.bucket, key)


def parse(url: str, scheme: str) -> ObjectUrl:
    """``scheme://bucket/key`` split; ValueError for what is not such a URL."""
    start = f"{scheme}://"
    if not url.lower().startswith(start):
        raise ValueError(f"{url!r} is not an {start} URL ({start}bucket/key)")
    bucket, _, key = url[len(start) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: write {start}bucket/key")
    return ObjectUrl(scheme, bucket, key)


class Head(NamedTuple):
    size: int
    etag: str | None


class Answer(NamedTuple):
    """A ranged GET's answer, its body not read yet."""

    length: int  # bytes in the body
    total: int | None  # the object's size, where the answer says it (a ranged answer does)
    etag: str | None
    readinto: Callable[[memoryview], int]  # reads body bytes straight into the buffer; 0 at its end
    done: Callable[[bool], None]  # lets the body go, given whether it was read to its end


class Page(NamedTuple):
    keys: list[str]  # objects under the prefix (directly under it, with a delimiter)
    prefixes: list[str]  # with a delimiter: the prefixes one level down, ending in "/"
    token: Any  # where the next page starts; None on the last


class Upload(NamedTuple):
    key: str
    upload_id: str
    started: datetime.datetime


def total_of(content_range: str | None) -> int | None:
    """The object's size in a ranged answer's Content-Range (``bytes 0-9/1234``); None where the
    header is absent or gives none (``*``)."""
    whole = (content_range or "").rpartition("/")[2]
    return int(whole) if whole.isdigit() else None


def failed_deletions(keys: Sequence[str], answers: Iterable[Any],
                     code: Callable[[Any], str] = lambda a: str(a.status_code)) -> list[tuple[str, str, str]]:
    """``delete_many``'s failures of a batch of deletions: the key, its answer's ``code`` and
    reason, for each answer (``status_code`` and ``reason`` each) that is no success; a key gone
    already counts as deleted, as S3 says."""
    return [(key, code(a), str(a.reason)) for key, a in zip(keys, answers, strict=False)
            if a.status_code >= 300 and a.status_code != 404]


def crc_b64(crc: int) -> str:
    """A CRC-32C as the stores spell it (S3's x-amz-checksum-crc32c, GCS's ``crc32c``): base64 of
    its four bytes, big-endian."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def body_reader(raw: Any, close: Callable[[], None], fallback: Callable[[memoryview], int] | None = None,
                ) -> tuple[Callable[[memoryview], int], Callable[[bool], None]]:
    """An ``Answer``'s ``readinto`` and ``done`` for a GET's body whose bytes come through urllib3's
    response ``raw``, let go by ``close``. http.client's own readinto, under urllib3's, fills the
    buffer in place where the body comes as sent (no content coding for urllib3 to undo); else the
    library's readinto (``fallback``, or urllib3's) reads a bytes object and copies it."""
    fp = getattr(raw, "_fp", None)
    if (isinstance(fp, http.client.HTTPResponse) and callable(getattr(raw, "release_conn", None))
            and not raw.headers.get("content-encoding")):

        def done(whole: bool) -> None:
            if whole and fp.isclosed():  # read to its Content-Length: the connection serves the next request
                raw.release_conn()
            else:
                close()

        return fp.readinto, done
    return fallback or raw.readinto, lambda whole: close()


class ViewBody(io.RawIOBase):
    """A read-only, seekable file over a memoryview: a client library sends it (and rewinds it to
    retry) without copying the bytes."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> Any:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = self._view[self._pos : end]
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        memoryview(b).cast("B")[: len(data)] = data
        return len(data)


class Words(NamedTuple):
    """How one store's typed errors name its parts, and what they tell to check."""

    endpoint: str  # where the endpoint is set (checked where a bucket is missing)
    network: str  # checked, with the network, where the connection fails
    bucket: str = "bucket"  # what holds the objects
    obj: str = "object"
    access: str = "the credentials and their"  # whose permissions on the bucket are checked
    more: str = ""  # how to allow more attempts, where throttling outlasted them


Failure = Literal["bucket", "object", "denied", "throttled", "other"]


def answer_error(url: ObjectUrl | str, what: str, failure: Failure, code: str, text: str, words: Words,
                 attempts: str = "its retries") -> ObjectStoreError:
    """The typed error of a store's answer to a failed request (``what``: the operation, for the
    message; ``failure``: what the adapter made of the answer; ``code``: the store's own name of
    it, kept in the error; ``attempts``: how many were made, for a throttled request's message)."""
    name = str(url)
    bucket = url.bucket if isinstance(url, ObjectUrl) else name
    if failure == "bucket":
        return BucketNotFoundError(name, f"the {words.bucket} {bucket!r} does not exist ({what}); create it first, "
                                   f"or check the URL and {words.endpoint}", code)
    if failure == "object":
        return ObjectNotFoundError(name, f"no such {words.obj} ({what})", code)
    if failure == "denied":
        return AccessDeniedError(name, f"access denied ({what}: {code}: {text}); check {words.access} permissions "
                                 f"on the {words.bucket} {bucket!r}", code)
    if failure == "throttled":
        return ThrottledError(name, f"the store throttled {what} ({code}: {text}) through {attempts}; retry later"
                              f"{words.more}", code)
    return ObjectStoreError(name, f"{what} failed ({code}: {text})", code)


def lost_error(url: ObjectUrl | str, what: str, e: Exception, words: Words) -> ConnectionLostError:
    """The typed error of a request whose connection failed through every retry."""
    return ConnectionLostError(str(url), f"the connection to the store failed during {what} after every retry ({e}); "
                               f"check {words.network} and the network")


class ObjectClient(Protocol):
    """One cloud's client, bound to one endpoint and one socket timeout."""

    name: str  # the store, for messages ("S3")
    endpoint: str  # where requests go, noted in the upload journal
    min_part: int  # the smallest part but the last
    max_part: int
    max_parts: int
    page: int  # keys per listing page and uploads per uploads page, at most
    delete_batch: int  # keys per delete_many
    attempts: int  # asks of a ranged read whose body breaks midway
    words: Words  # how its typed errors name its parts, and what they tell to check

    def head(self, url: ObjectUrl) -> Head: ...
    def check_bucket(self, url: ObjectUrl) -> None: ...
    def get(self, url: ObjectUrl, lo: int, hi: int, etag: str | None) -> Answer: ...  # bytes [lo, hi)
    def get_whole(self, url: ObjectUrl) -> tuple[int, Callable[[], bytes], Callable[[], None]]: ...  # size, read, close
    def put(self, url: ObjectUrl, data: memoryview, crc: int) -> None: ...
    def list_page(self, url: ObjectUrl, prefix: str, *, delimiter: bool, limit: int, token: Any) -> Page: ...
    def delete(self, url: ObjectUrl) -> None: ...
    def delete_many(self, url: ObjectUrl, keys: Sequence[str]) -> list[tuple[str, str, str]]: ...  # failures
    def create_upload(self, url: ObjectUrl) -> str: ...
    def upload_part(self, url: ObjectUrl, upload_id: str, number: int, data: memoryview, crc: int) -> str: ...
    def complete_upload(self, url: ObjectUrl, upload_id: str, parts: list[tuple[int, str, int]]) -> None: ...
    def abort_upload(self, url: ObjectUrl, upload_id: str) -> None: ...
    def list_uploads(self, url: ObjectUrl, prefix: str, *, limit: int, token: Any) -> tuple[list[Upload], Any]: ...
    def touched(self, url: ObjectUrl, upload: Upload) -> datetime.datetime: ...
    def error(self, e: Exception, url: ObjectUrl | str, what: str) -> Exception: ...


def call(client: ObjectClient, url: ObjectUrl, what: str, method: Callable[..., Any], /, *args: Any,
         nbytes: int = 0, limits: s3deadline.Limits | None = None, missing_is_bucket: bool = False) -> Any:
    """``method(*args)``, a request of ``nbytes`` bytes, held to its deadline (the settings in
    force, or ``limits``); its failure typed (``what``: the operation, for the message). With
    ``missing_is_bucket``, for a request that names no object which may be missing (a listing,
    an upload), a not-found answer says that the bucket is missing (some stores answer a bare 404)."""
    with s3deadline.Deadline(url, what, nbytes, limits):
        try:
            return method(*args)
        except CkptStreamError:
            raise
        except Exception as e:
            typed = client.error(e, url, what)
            if typed is e:
                raise
            if missing_is_bucket and isinstance(typed, ObjectNotFoundError):
                typed = answer_error(url, what, "bucket", "NoSuchBucket", "", client.words)
            raise typed from e
