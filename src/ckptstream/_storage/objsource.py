"""An object opened for reading, through any ``ObjectClient``: ranged GETs straight into the
staging buffers, from as many threads as the transfer has.

Opening is one ranged GET of the object's first bytes, which also gives its size and ETag: a
reader's first read (the header) is then served from them, without a request of its own. Every
later read asks for that version (If-Match) and checks the answer's ETag, so an object replaced
meanwhile fails the read instead of mixing two versions, also where the store ignores If-Match.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .._errors import (
    ConnectionLostError,
    ObjectNotFoundError,
    ObjectReplacedError,
    ObjectStoreError,
)
from .._settings import DirectIO
from . import s3deadline
from .base import Source
from .objclient import EMPTY_RANGE, REPLACED, Answer, Head, ObjectClient, ObjectUrl, call

log = logging.getLogger(__name__)

# bytes of an object fetched when it is opened, with its size and ETag: as many as a reader's
# first read (the header of most checkpoints), so that it needs no request of its own
FIRST = 1 << 20


class ObjectSource(Source):
    """``url`` opened for reading through ``client`` (see the module's docstring)."""

    def __init__(self, url: ObjectUrl, client: ObjectClient) -> None:
        self.url, self.name = url, str(url)
        self._client = client
        self._limits = s3deadline.limits()  # the caller's: reads come from the transfer's threads
        self._first = b""  # the object's first bytes, until a read has used them up
        with s3deadline.Deadline(url, "opening the object", FIRST, self._limits) as deadline:
            self._size, self._etag = self._open(deadline)

    def _open(self, deadline: s3deadline.Deadline) -> tuple[int, str | None]:
        """The size and ETag, keeping the first bytes where they come whole; an empty object
        (which has no byte range to ask for) is looked at with a HEAD instead."""
        what = "opening the object"
        try:
            answer = self._client.get(self.url, 0, FIRST, None)
        except Exception as e:
            typed = self._client.error(e, self.url, what)
            if getattr(typed, "code", None) in EMPTY_RANGE:
                head = head_of(self._client, self.url, what)
                return head.size, head.etag
            raise typed from e  # (a GET, unlike a HEAD, says NoSuchBucket where the bucket is missing)
        length = answer.length
        size = answer.total if answer.total is not None else length  # no range: the whole object came
        # more than asked for: a server that ignores ranges (the reads will say so); take nothing
        first, got = bytearray(length if length <= FIRST else 0), 0
        try:
            view = memoryview(first)
            while got < len(first) and (n := answer.readinto(view[got:])):
                got += n
        except Exception:
            pass  # a body broken midway: the reads ask again
        finally:
            answer.done(got == length)
        if got < len(first):
            deadline.check()  # unless it stalled until the deadline: then the store is not answering
        if got == length <= FIRST:
            self._first = bytes(first)
        return size, answer.etag

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
        with s3deadline.Deadline(self.url, f"reading bytes {offset}..{offset + want}", want, self._limits) as deadline:
            self._get_within(deadline, targets, offset, want)
        return want

    def _get_within(self, deadline: s3deadline.Deadline, views: list[memoryview], offset: int, want: int) -> None:
        """Fill ``views`` (``want`` bytes in all) from ``offset``; a connection that breaks while
        the body streams is asked again for the rest (clients retry only the request itself),
        a bounded number of times, all within one deadline."""
        got, failures, at, into = 0, 0, 0, 0  # bytes done; the view being filled, and how far
        while got < want:
            if failures:
                deadline.check()  # a connection shut at the deadline is not asked again
            lo, hi = offset + got, offset + want
            what = f"reading bytes {lo}..{hi}"
            try:
                answer = self._check_answer(self._client.get(self.url, lo, hi, self._etag), what, hi - lo)
                try:
                    while got < want and (n := answer.readinto(views[at][into:])):
                        got, into = got + n, into + n
                        if into == len(views[at]):
                            at, into = at + 1, 0
                finally:
                    answer.done(got == want)
                if got == want:
                    return
                cause: Exception = ConnectionError(f"the body ended {hi - lo - (offset + got - lo)} bytes early")
            except ObjectStoreError:
                raise
            except Exception as e:
                typed = self._client.error(e, self.url, what)
                code = getattr(typed, "code", None)
                if code in REPLACED or code in EMPTY_RANGE:
                    # not the ETag opened, or no longer the bytes asked for (all lie within the size opened)
                    raise ObjectReplacedError(self.name, f"{what}: the object was replaced while it was read "
                                              "(its ETag or size changed since it was opened); load it again",
                                              code) from e
                if not isinstance(typed, ConnectionLostError):
                    raise typed from e
                cause = e
            failures += 1
            log.debug("%s: %s broke (%s); asking again for the rest (%d of %d)", self.name, what, cause, failures,
                      self._client.attempts)
            if failures >= self._client.attempts:
                raise ConnectionLostError(self.name, f"{what}: the connection broke {failures} times while "
                                                   f"the body streamed ({cause})") from cause

    def _check_answer(self, answer: Answer, what: str, length: int) -> Answer:
        """The answer of a ranged GET, once it is of the opened object and of the range. A store
        that ignores If-Match (rclone does) answers with a replaced object's new bytes: its ETag
        or size tells them apart before they reach a tensor or its checksum (ObjectReplacedError)."""
        etag = answer.etag
        size = answer.total if answer.total is not None else self._size
        if size != self._size or (etag is not None and self._etag is not None and etag != self._etag):
            answer.done(False)
            raise ObjectReplacedError(self.name, f"{what}: the object was replaced while it was read (opened: "
                                      f"{self._size} bytes, ETag {self._etag}; now: {size} bytes, ETag {etag}); "
                                      "open it again", "PreconditionFailed")
        if answer.length != length:  # a server that ignored the range sent it all
            answer.done(False)
            raise ObjectStoreError(self.name, f"{what}: the store answered {answer.length} "
                                   f"bytes, not {length}; it does not serve byte ranges")
        return answer

    def close(self) -> None:
        self._first = b""


def head_of(client: ObjectClient, url: ObjectUrl, what: str) -> Head:
    """The object's size and ETag (one HEAD); a missing bucket is told apart from a missing
    object (a HEAD answers a bare 404 for both)."""
    try:
        head: Head = call(client, url, what, client.head, url)
        return head
    except ObjectNotFoundError:
        call(client, url, "looking at the bucket", client.check_bucket, url, missing_is_bucket=True)
        raise

