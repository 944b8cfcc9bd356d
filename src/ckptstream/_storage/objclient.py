"""The client protocol under the object-store layer: what ``objstore`` (the namespace),
``objsource`` (ranged reads) and ``objupload`` (multipart writes) ask of one cloud's client.

An adapter (``s3``) implements ``ObjectClient`` over its own library: each method is one
request, raising what the library raises; ``error`` turns that into ckptstream's typed errors.
The layer above wraps every call in its deadline and its error mapping (``call``), so an
adapter holds no retry, deadline, pagination or part-numbering logic of its own.

Error codes the layer acts on (an adapter's typed errors carry them in ``code``):
``REPLACED`` (the ETag asked for is no longer the object's) and ``EMPTY_RANGE`` (no bytes in
the range asked for: an empty object, or one replaced by a shorter one).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from .._errors import CkptStreamError
from . import s3deadline

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
    bucket_hint: str  # what to check where a bucket is missing (the variable naming the endpoint)

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
         nbytes: int = 0, limits: s3deadline.Limits | None = None) -> Any:
    """``method(*args)``, a request of ``nbytes`` bytes, held to its deadline (the settings in
    force, or ``limits``); its failure typed (``what``: the operation, for the message)."""
    with s3deadline.Deadline(url, what, nbytes, limits):
        try:
            return method(*args)
        except CkptStreamError:
            raise
        except Exception as e:
            typed = client.error(e, url, what)
            if typed is e:
                raise
            raise typed from e
