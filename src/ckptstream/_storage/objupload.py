"""A new object written as one multipart upload, straight from the staging buffers, through any
``ObjectClient`` (its part limits: S3's are 5 MiB to 5 GiB, 10,000 parts).

The engine writes chunks on the sink's grid (the part size, ``buffer_size``): each chunk is one
part, uploaded from the staging buffer by the I/O thread that filled it, before the buffer is
released, so several parts are in flight (one per I/O thread) and nothing is copied. The
object's head (the safetensors header and the first data bytes, at least the store's minimum
part) is held back in a small buffer instead: the header is written again, with its checksums,
once the data is out, and the head goes up last, as part 1. Completing the upload publishes the
object whole; aborting it leaves the old object (if any) as it was.

    parts:  | 1: head [0, E) held back | 2: [E, next multiple of S) | 3: [k*S, (k+1)*S) | ... | last (short) |
"""

from __future__ import annotations

import logging
import threading

from .. import _checksum
from .._errors import ObjectStoreError
from .._settings import DirectIO
from . import s3deadline, s3journal
from .base import Sink, round_up
from .objclient import ObjectClient, ObjectUrl, call

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_PART = 16 * MiB  # until the engine's grid sets it (a small object written without one)

_live: set[str] = set()  # this process's uploads in flight: never taken for a dead writer's
_live_lock = threading.Lock()


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def check_part_size(url: ObjectUrl, client: ObjectClient, buffer_size: int, direct_io: DirectIO) -> None:
    if direct_io is DirectIO.ON:
        raise ValueError(f"{url}: direct_io='on' is for local files; an object store takes 'auto' or 'off'")
    lo, hi = client.min_part, client.max_part
    if not lo <= buffer_size <= hi:
        raise ValueError(f"{url}: buffer_size is the part size of an upload to an object store, which {client.name} "
                         f"allows from {lo} ({_size(lo)}) to {hi} ({_size(hi)}) bytes; got {buffer_size}: set "
                         "ckptstream.settings(buffer_size=...) in that range")


class MultipartSink(Sink):
    """Writes to ``url`` as one multipart upload (see the module's docstring); an object that
    ends inside the head is written with one PUT instead."""

    def __init__(self, url: ObjectUrl, client: ObjectClient) -> None:
        self.url, self.name = url, str(url)
        self._client = client
        self._limits = s3deadline.limits()  # the caller's: parts go up from the transfer's threads
        self._part = DEFAULT_PART
        self._first = self._first_part(DEFAULT_PART)
        self._head = bytearray()  # bytes [0, head_end)
        self._head_end = self._first  # E: where part 2 starts
        self._header_end = 0  # the end of the longest write at offset 0 (the header)
        self._lock = threading.Lock()
        self._upload_id: str | None = None
        self._start_failed: Exception | None = None
        self._parts: dict[int, tuple[int, int, str, int]] = {}  # part -> (offset, length, etag, crc)
        self._end = 0  # the end of the furthest write
        self._state = "open"  # then "published" or "abandoned"

    def _first_part(self, part: int) -> int:
        """The head's least size: the store's minimum, where the rest of the first grid cell
        still makes a part of at least that size; else the whole first cell."""
        least = self._client.min_part
        return least if part >= 2 * least else part

    def grid(self, buffer_size: int, direct_io: DirectIO) -> int:
        check_part_size(self.url, self._client, buffer_size, direct_io)
        with self._lock:
            if self._upload_id is None:
                self._part, self._first = buffer_size, self._first_part(buffer_size)
                log.debug("%s: parts of %d bytes, the held-back head of %d", self.url, self._part, self._first)
                self._place_head()
        return self._part

    def _place_head(self) -> None:
        """Where part 2 starts: after the least head, or, for a header longer than that, after
        the grid cell the header ends in. Fixed once the upload has begun."""
        h = self._header_end
        self._head_end = self._first if h <= self._first else round_up(h, self._part)

    # --- writes ---------------------------------------------------------------------------

    def write_at(self, view: memoryview, offset: int) -> None:
        if not len(view):
            return
        end = offset + len(view)
        with self._lock:
            self._check_open()
            if offset == 0 and end > self._header_end and self._upload_id is None:
                self._header_end = end
                self._place_head()
            self._end = max(self._end, end)
            if offset < self._head_end:
                stop = min(end, self._head_end)
                if len(self._head) < stop:
                    self._head.extend(bytes(stop - len(self._head)))
                self._head[offset:stop] = view[: stop - offset]
        at = max(offset, self._head_end)
        while at < end:
            number, boundary = self._part_at(at)
            stop = min(end, boundary)
            self._upload_part(number, view[at - offset : stop - offset], at)
            at = stop

    def _part_at(self, offset: int) -> tuple[int, int]:
        """The number of the part that starts at ``offset`` and where the next one starts."""
        e, s = self._head_end, self._part
        g = round_up(e, s)
        if offset == e:
            number = 2
        elif offset > e and offset % s == 0:
            number = 2 + (offset - g) // s + (g != e)
        else:
            raise ValueError(f"{self.name}: a write at offset {offset} does not start a part (parts start at "
                             f"{e} and at multiples of {s}); an object store's writes follow the sink's grid")
        most = self._client.max_parts
        if number > most:
            raise ObjectStoreError(self.name, f"the object needs more than {most} parts of {s} bytes "
                                   f"({self._client.name}'s limit); raise buffer_size to at least "
                                   f"{-(-self._end // (most - 1))}")
        return number, (g if offset < g else offset + s)

    def _upload_part(self, number: int, data: memoryview, offset: int) -> None:
        upload_id = self._ensure_upload()
        crc = _checksum.crc_of(data)
        etag: str = call(self._client, self.url, f"uploading part {number} (bytes {offset}..{offset + len(data)})",
                         self._client.upload_part, self.url, upload_id, number, data, crc, nbytes=len(data),
                         limits=self._limits, missing_is_bucket=True)
        with self._lock:
            self._parts[number] = (offset, len(data), etag, crc)

    def _ensure_upload(self) -> str:
        with self._lock:
            self._check_open()
            if self._start_failed is not None:
                raise self._start_failed  # once per sink: the store has answered, after its retries
            if self._upload_id is None:
                try:
                    upload_id: str = call(self._client, self.url, "starting a multipart upload",
                                          self._client.create_upload, self.url, limits=self._limits)
                except Exception as e:
                    self._start_failed = e
                    raise
                self._upload_id = upload_id
                with _live_lock:
                    _live.add(upload_id)
                s3journal.record(self._client.endpoint, self.url.bucket, self.url.key, upload_id)
            return self._upload_id

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"{self.name}: the sink was {self._state}; create a new one to write again")

    # --- publish / abandon ----------------------------------------------------------------

    def publish(self) -> None:
        with self._lock:
            if self._state == "published":
                return
            self._check_open()
            upload_id = self._upload_id
        try:
            if upload_id is None:
                self._put_whole()
            else:
                self._complete(upload_id)
        except BaseException:
            self.abandon()
            raise
        self._state = "published"

    def _put_whole(self) -> None:
        """An object within its head: one PUT."""
        data = memoryview(self._head)[: self._end]
        call(self._client, self.url, f"writing the object ({len(data)} bytes)", self._client.put, self.url, data,
             _checksum.crc_of(data), nbytes=len(data), limits=self._limits, missing_is_bucket=True)

    def _complete(self, upload_id: str) -> None:
        head = memoryview(self._head)[: min(self._end, self._head_end)]
        if len(self._head) < self._head_end and self._end > self._head_end:
            raise ObjectStoreError(self.name, f"the head holds {len(self._head)} bytes, expected {self._head_end}")
        self._check_parts()
        self._upload_part(1, head, 0)
        parts = [(n, etag, crc) for n, (_, _, etag, crc) in sorted(self._parts.items())]
        # the store assembles the object's bytes before it answers: they count in the deadline
        call(self._client, self.url, f"completing the upload of {len(parts)} parts", self._client.complete_upload,
             self.url, upload_id, parts, nbytes=self._end, limits=self._limits)
        self._forget(upload_id)

    def _check_parts(self) -> None:
        """The parts cover the bytes after the head back to back, every one but the last a full
        part: anything else is a writer's bug, refused before the object is made."""
        at = self._head_end
        numbers = sorted(self._parts)
        for i, n in enumerate(numbers):
            offset, length, _, _ = self._parts[n]
            _expected, boundary = self._part_at(offset)
            if n != i + 2 or offset != at or (n != numbers[-1] and offset + length != boundary):
                raise ObjectStoreError(self.name, f"part {n} holds bytes {offset}..{offset + length}; expected "
                                       f"part {i + 2} from byte {at}: the writes left a hole")
            at = offset + length
        if at != self._end:
            raise ObjectStoreError(self.name, f"the parts end at byte {at}, the writes at {self._end}")

    def abandon(self) -> None:
        with self._lock:
            if self._state != "open":
                return
            self._state = "abandoned"
            upload_id = self._upload_id
        if upload_id is None:
            return
        try:
            call(self._client, self.url, "aborting the upload", self._client.abort_upload, self.url, upload_id,
                 limits=self._limits)
        except Exception:
            # unreachable store: the upload stays until a later writer of the key (or the store's
            # own expiry) aborts it; the journal tells it is abandoned
            with _live_lock:
                _live.discard(upload_id)
            return
        self._forget(upload_id)

    def _forget(self, upload_id: str) -> None:
        with _live_lock:
            _live.discard(upload_id)
        s3journal.forget(self.url.bucket, self.url.key, upload_id)

    def close(self) -> None:
        self.abandon()

    @staticmethod
    def live_uploads() -> set[str]:
        with _live_lock:
            return set(_live)
