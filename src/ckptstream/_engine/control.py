"""The life of a transfer's threads: the first error and the stop flag they share, and Ctrl-C.

A transfer must never leave the caller with its I/O threads still running: such a thread could
fill a staging buffer already back in the pool, or write to a descriptor that was closed and
reused for another file. So the engine's own threads are joined on every path, and while a
transfer runs in the main thread a Ctrl-C only stops it: the KeyboardInterrupt is raised once
every thread is joined and the staging buffers are back, however many interrupts arrive. It is
raised plain, without the internal TransferCancelled that stopped the transfer (which
``CKPTSTREAM_DEBUG=1`` shows as its context); an error the transfer met on its own stays its
context.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence

from .._errors import CkptStreamError, ThreadStartError


class TransferCancelled(CkptStreamError, RuntimeError):
    """The transfer was stopped (``cancel()`` or Ctrl-C) before it finished."""


class Failure:
    """The first error of a transfer (in file order, where several threads fail) and the flag
    that stops its threads at their next chunk."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._where = 0
        self.flag = ctypes.c_int32(0)  # the stop flag as native code reads it (hotloop.c)

    @property
    def stopped(self) -> bool:
        return bool(self.flag.value)

    def record(self, error: BaseException, where: int = 0) -> None:
        """Keep ``error`` if it is the first, or earlier in the file than the one kept; stop."""
        with self._lock:
            if self.error is None or where < self._where:
                self.error, self._where = error, where
            self.flag.value = 1

    def stop(self) -> None:
        self.flag.value = 1

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error
        if self.stopped:
            raise TransferCancelled("the transfer was cancelled before it finished")


class _InterruptScope:
    """While installed: SIGINT calls every registered stop and is remembered, not raised."""

    def __init__(self) -> None:
        self.interrupted = False
        self.stops: list[Callable[[], None]] = []

    def handle(self, signum: int, frame: object) -> None:
        self.interrupted = True
        for stop in list(self.stops):
            stop()


_scope: _InterruptScope | None = None


@contextlib.contextmanager
def interrupts_deferred(stop: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside the block a Ctrl-C calls ``stop`` (and those of enclosing blocks) and is raised as
    KeyboardInterrupt when the outermost block exits. Only in the main thread while Python's
    default SIGINT handler is installed; elsewhere the block runs as it is (a handler of the
    program's own, or SIGINT ignored, stays in charge)."""
    global _scope
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _scope is not None:  # nested: join the enclosing scope
        if stop is not None:
            _scope.stops.append(stop)
        try:
            yield
        finally:
            if stop is not None:
                _scope.stops.remove(stop)
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    scope = _InterruptScope()
    if stop is not None:
        scope.stops.append(stop)
    _scope = scope
    signal.signal(signal.SIGINT, scope.handle)
    raised: BaseException | None = None
    try:
        yield
    except BaseException as e:
        raised = e
        raise
    finally:
        # the scope is closed first: a signal still pending while the default handler comes back
        # raises KeyboardInterrupt right here, which is what closing would raise anyway
        _scope = None
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        finally:
            if scope.interrupted:
                if isinstance(raised, TransferCancelled) and not debugging():
                    # the stop the interrupt asked for: the user sees a plain KeyboardInterrupt
                    raise KeyboardInterrupt from None
                raise KeyboardInterrupt  # chained to the error the block raised (a real failure)


@functools.cache
def debugging() -> bool:
    """``CKPTSTREAM_DEBUG`` (read once) is set to anything but "", "0", "false", "no" or "off":
    a Ctrl-C's KeyboardInterrupt then shows the cancelled transfer it ended as its context."""
    return os.environ.get("CKPTSTREAM_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def join(threads: Sequence[threading.Thread], on_interrupt: Callable[[], None] | None = None) -> None:
    """Join every thread; a KeyboardInterrupt (a program's own SIGINT handler, outside a deferred
    scope) is held back until all are joined, calling ``on_interrupt`` (to tell them to stop)."""
    pending: BaseException | None = None
    for thread in threads:
        while True:
            try:
                thread.join()
                break
            except KeyboardInterrupt as e:
                pending = pending or e
                if on_interrupt is not None:
                    on_interrupt()
    if pending is not None:
        raise pending


def start(thread: threading.Thread, what: str) -> None:
    """Start ``thread`` (``what`` names it for the message), raising ThreadStartError where the
    process cannot start one (Python's plain RuntimeError says only "can't start new thread")."""
    try:
        thread.start()
    except RuntimeError as e:
        raise ThreadStartError(
            f"ckptstream could not start {what}: {e}. The process has reached a limit on threads or on the memory "
            "of their stacks: the user's process limit (ulimit -u), the container's pids limit (pids.max), or the "
            "address space (ulimit -v); raise that limit, end threads the program no longer needs, or set fewer "
            "io_threads (ckptstream.settings)") from e


class Stopped(Exception):
    """Raised in an I/O thread that learns, while it waits, that the transfer stopped."""


def raise_if_interrupted() -> None:
    """Raise TransferCancelled when a Ctrl-C arrived inside the enclosing deferred scope (the
    scope then raises it as KeyboardInterrupt): a step that must not follow an interrupt, such
    as publishing a file, goes after this."""
    if _scope is not None and _scope.interrupted and threading.current_thread() is threading.main_thread():
        raise TransferCancelled("interrupted")
