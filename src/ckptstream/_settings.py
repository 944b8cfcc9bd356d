"""Runtime options: one frozen Settings object, scoped overrides, environment fallback."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from ._fileio import ALIGN

MiB = 1 << 20


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _env_direct_io(default: bool | None) -> bool | None:
    raw = os.environ.get("CKPTSTREAM_DIRECT_IO")
    if raw is None:
        return default
    table = {"auto": None, "1": True, "on": True, "true": True, "0": False, "off": False, "false": False}
    if raw.lower() not in table:
        raise ValueError(f"CKPTSTREAM_DIRECT_IO={raw!r}: expected one of {sorted(table)}")
    return table[raw.lower()]


@dataclasses.dataclass(frozen=True)
class Settings:
    """Defaults for every transfer; per-call arguments override them.

    Attributes:
        buffer_size: bytes per staging buffer (pinned on a GPU machine).
        num_buffers: staging buffers in flight; host memory is about num_buffers x buffer_size.
        io_threads: threads doing file I/O (and checksums) per transfer.
        direct_io: True forces O_DIRECT (error where the file system refuses it; buffer_size must
            be a multiple of 4096), False forces buffered I/O, None uses O_DIRECT for writes where
            the file system and alignment allow (reads keep the page cache).
    """

    # Defaults chosen from the sweep in docs/benchmarks.md (H200 machine, ext4).
    buffer_size: int = 16 * MiB
    num_buffers: int = 8
    io_threads: int = 8
    direct_io: bool | None = None

    def __post_init__(self) -> None:
        for name in ("buffer_size", "num_buffers", "io_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.direct_io not in (None, True, False):
            raise ValueError(f"direct_io must be True, False or None, got {self.direct_io!r}")
        if self.direct_io and self.buffer_size % ALIGN:
            # checked here, before a transfer opens (and maybe truncates) its file
            raise ValueError(f"direct_io=True needs buffer_size to be a multiple of {ALIGN}, "
                             f"got {self.buffer_size}")


def _from_environment() -> Settings:
    base = Settings()
    return Settings(
        buffer_size=_env_int("CKPTSTREAM_BUFFER_SIZE", base.buffer_size),
        num_buffers=_env_int("CKPTSTREAM_NUM_BUFFERS", base.num_buffers),
        io_threads=_env_int("CKPTSTREAM_IO_THREADS", base.io_threads),
        direct_io=_env_direct_io(base.direct_io),
    )


_current: contextvars.ContextVar[Settings] = contextvars.ContextVar(
    "ckptstream_settings", default=_from_environment()  # noqa: B039 (Settings is frozen)
)


def current_settings() -> Settings:
    """The settings in force in this thread / context."""
    return _current.get()


@contextlib.contextmanager
def settings(**overrides: Any) -> Iterator[Settings]:
    """Override the defaults inside a ``with`` block (this thread / context only).

    Example:
        >>> with ckptstream.settings(buffer_size=64 << 20, num_buffers=2):
        ...     ckptstream.device_to_file(tensor, "t.bin")
    """
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(Settings)]}")
    token = _current.set(dataclasses.replace(_current.get(), **overrides))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def resolve(**per_call: Any) -> Settings:
    """Settings for one call: the scoped defaults with the call's non-None arguments."""
    given = {k: v for k, v in per_call.items() if v is not None}
    return dataclasses.replace(_current.get(), **given) if given else _current.get()
