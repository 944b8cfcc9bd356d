"""Deadlines of object-store requests: each operation (one request with its retries, or a ranged
read with its re-asks) ends within ``s3_timeout + bytes / s3_min_rate`` seconds whatever the
server does: freeze, send its headers and then nothing, or drip a byte at a time.

botocore's socket timeouts bound one read of a socket, not a request (a drip never trips them),
and its retries multiply them. So a watchdog thread shuts down the socket of an operation past
its deadline (the read or write blocked on it returns at once), no retry starts after it, and
the operation raises ``DeadlineExceededError`` naming the URL, the operation and the deadline.
The clients' connections are of a class that tells the watchdog which operation uses them
(``watched_pools``: botocore's pools, or urllib3's under a ``requests`` session).

    with Deadline(url, "uploading part 3", len(data), limits):
        client.upload_part(...)
"""

from __future__ import annotations

import contextlib
import heapq
import os
import socket
import threading
import time
from typing import Any, NamedTuple

from .._errors import CkptStreamError, ConnectionLostError, DeadlineExceededError
from .._settings import current_settings


class Limits(NamedTuple):
    timeout: float  # s3_timeout: seconds to connect and to start an answer
    min_rate: int  # s3_min_rate: bytes per second


def limits() -> Limits:
    """The limits of the settings in force (read in the caller's thread: the I/O threads of a
    transfer see only the environment's)."""
    cfg = current_settings()
    return Limits(cfg.s3_timeout, cfg.s3_min_rate)


class _Passed(Exception):
    """Raised into botocore where an attempt would start past its operation's deadline."""


_local = threading.local()


def _active() -> list[Deadline]:
    stack: list[Deadline] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class Deadline:
    """One operation's deadline, in force in this thread inside the ``with`` block (nested ones
    too: an inner request is bounded by every deadline around it)."""

    def __init__(self, url: object, what: str, nbytes: int = 0, given: Limits | None = None) -> None:
        self.url, self.what, self.nbytes = str(url), what, nbytes
        self.limits = given or limits()
        self.seconds = self.limits.timeout + nbytes / self.limits.min_rate
        self.at = time.monotonic() + self.seconds
        self.expired = False  # the watchdog shut this operation's connections down
        self.done = False
        self.connections: list[Any] = []

    def __enter__(self) -> Deadline:
        _active().append(self)
        _watchdog().add(self)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.done = True
        _active().remove(self)
        self.connections.clear()
        if isinstance(exc, Exception) and not isinstance(exc, DeadlineExceededError) and self.passed() and _lost(exc):
            raise self.error() from exc

    def passed(self) -> bool:
        return self.expired or time.monotonic() >= self.at

    def check(self) -> None:
        """Raise ``DeadlineExceededError`` once the deadline has passed (before asking again)."""
        if self.passed():
            raise self.error()

    def error(self) -> DeadlineExceededError:
        timeout, rate = self.limits
        return DeadlineExceededError(
            self.url, f"{self.what} did not end within its deadline of {self.seconds:.1f} s (s3_timeout {timeout:g} s "
            f"+ {self.nbytes} bytes at s3_min_rate {rate} bytes/s), retries included: the store stopped answering or "
            "answers too slowly; check it and the network, or, for a slow link, raise s3_timeout or lower "
            "s3_min_rate (ckptstream.settings(...), CKPTSTREAM_S3_TIMEOUT, CKPTSTREAM_S3_MIN_RATE)", self.what,
            self.seconds)

    def _expire(self) -> None:
        if self.done:
            return  # ended meanwhile: its connections may serve others now
        self.expired = True
        for conn in list(self.connections):
            if self in getattr(conn, "_ckptstream_deadlines", ()):  # not since taken by another operation
                _shut(getattr(conn, "sock", None))


def _lost(exc: Exception) -> bool:
    """Whether ``exc`` is what a connection shut down, or a retry refused, raises."""
    if isinstance(exc, ConnectionLostError | _Passed):
        return True
    if isinstance(exc, CkptStreamError):
        return False  # the store's own answer (denied, throttled, ...): it says more
    from botocore.exceptions import BotoCoreError

    return isinstance(exc, BotoCoreError | OSError)


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def watch(conn: Any) -> None:
    """``conn`` is about to carry a request of this thread's operations (if any)."""
    stack = _active()
    conn._ckptstream_deadlines = tuple(stack)
    for deadline in stack:
        deadline.connections.append(conn)


def passed() -> bool:
    """Whether an operation of this thread is past its deadline (a retry predicate's question)."""
    return any(d.passed() for d in _active())


def refuse_past_deadline(**kwargs: Any) -> None:
    """botocore's ``before-send`` (and any client's hook before each attempt): no attempt starts
    past its operation's deadline."""
    if passed():
        raise _Passed("the operation's deadline has passed")


def no_retry_past_deadline(**kwargs: Any) -> bool | None:
    """botocore's ``needs-retry`` (first in line): no retry past the deadline (False); else the
    retry policy decides (None)."""
    return False if passed() else None


class _Watchdog:
    """One thread for the process, asleep until the nearest deadline (never joined: it holds no
    resource and waits on a condition; a forked child makes its own)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._thread: threading.Thread | None = None

    def add(self, deadline: Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline.at, id(deadline), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptstream-s3-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is deadline:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, _, deadline = heapq.heappop(self._heap)
            deadline._expire()


_dog: _Watchdog | None = None
_dog_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    global _dog
    with _dog_lock:
        if _dog is None:
            _dog = _Watchdog()
        return _dog


def _forget_watchdog() -> None:
    global _dog, _dog_lock
    _dog, _dog_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_watchdog)


def watched_pools(plain: Any, tls: Any) -> dict[str, Any]:
    """Subclasses of the pool classes ``plain`` and ``tls`` (urllib3's, or a library's own) whose
    connections, of each pool's own connection class, call ``watch`` before they connect and
    before each request."""

    class Watched:  # before the connection class: its connect and request call watch first
        def connect(self) -> None:
            watch(self)
            super().connect()  # type: ignore[misc]

        def request(self, *args: Any, **kwargs: Any) -> Any:
            watch(self)
            return super().request(*args, **kwargs)  # type: ignore[misc]

    def pool(base: Any) -> Any:
        class WatchedConnection(Watched, base.ConnectionCls):  # type: ignore[misc]
            pass

        class Pool(base):  # type: ignore[misc]
            ConnectionCls = WatchedConnection

        return Pool

    return {"http": pool(plain), "https": pool(tls)}


def pool_classes() -> dict[str, Any]:
    """botocore's connection pools, watched (``watched_pools``)."""
    from botocore.awsrequest import AWSHTTPConnectionPool, AWSHTTPSConnectionPool

    return watched_pools(AWSHTTPConnectionPool, AWSHTTPSConnectionPool)


def watch_session(session: Any) -> None:
    """The connections of a ``requests`` session's adapters watched: the pool classes go where
    urllib3 keeps them (requests has no public way), and the pools are made later, of these."""
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    for adapter in session.adapters.values():
        manager = getattr(adapter, "poolmanager", None)
        if manager is not None:
            manager.pool_classes_by_scheme = watched_pools(HTTPConnectionPool, HTTPSConnectionPool)
