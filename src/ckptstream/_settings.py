"""Runtime options: one frozen Settings object, scoped overrides, the environment as a fallback.

The ``CKPTSTREAM_*`` environment variables are read at the first transfer, not at import: a bad
value gives a clear error there and never breaks ``import ckptstream``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, TypedDict

if TYPE_CHECKING:
    from typing_extensions import Unpack

MiB = 1 << 20
ALIGN = 4096  # O_DIRECT alignment of buffer address, length and file offset


class DirectIO(str, enum.Enum):
    """Whether transfers use O_DIRECT (bypassing the page cache)."""

    AUTO = "auto"  # O_DIRECT for writes where the file system and alignment allow; reads keep the cache
    ON = "on"  # always; an error where the file system refuses it
    OFF = "off"  # never

    @classmethod
    def parse(cls, value: object) -> DirectIO:
        """A DirectIO from itself, its name, or the 0.1.0 spellings: True / False / None (auto)
        and, in the environment, 1 / true / 0 / false."""
        table = {None: cls.AUTO, True: cls.ON, False: cls.OFF}
        if isinstance(value, bool) or value is None:
            return table[value]
        if isinstance(value, str):
            text = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(value.lower(), value.lower())
            with contextlib.suppress(ValueError):
                return cls(text)
        raise ValueError(f"direct_io must be 'auto', 'on' or 'off' (or True / False), got {value!r}")


@dataclasses.dataclass(frozen=True, init=False)
class Settings:
    """The settings of a transfer: those in force (the defaults, the ``CKPTSTREAM_*``
    environment, ``with ckptstream.settings(...)``), or a value built here and given to one
    call as ``settings=`` (complete: the fields it leaves out take these defaults). Frozen, and
    checked when built.

    Attributes:
        buffer_size: bytes per staging buffer (pinned on a GPU machine).
        num_buffers: staging buffers in flight; host memory is about num_buffers x buffer_size.
        io_threads: threads doing file I/O (and checksums) per transfer.
        direct_io: "auto" uses O_DIRECT for writes where the file system and alignment allow
            (reads keep the page cache), "on" forces it (an error where the file system
            refuses it; buffer_size must be a multiple of 4096), "off" never uses it. Given as
            a ``DirectIO``, its value, or True / False / None (on / off / auto).
        hot_io_threads: I/O threads of a load (or a verify) whose bytes the page cache
            already holds (such a load is bound by memory copies, not by the disk), up to the
            number of cores; the same staging memory is split among them. A load into several
            GPUs, or into one where the CUDA runtime cannot be called directly, keeps
            io_threads. Set it to io_threads to turn this off.
        s3_timeout: seconds an object store (``s3://``) has to connect and to start its answer
            to a request; also the socket timeout of each attempt.
        s3_min_rate: the slowest bytes per second a request to an object store may move: each
            request, retries included (a ranged read with its re-asks), must end within
            ``s3_timeout + bytes / s3_min_rate`` seconds, else ``DeadlineExceededError``. They
            are read where an object is opened or created and where the storage is asked
            (listings, removals), from the settings in force there.

    Raises:
        ValueError: a value out of range, naming it.

    Example:
        >>> big = ckptstream.Settings(buffer_size=64 << 20, num_buffers=4, direct_io="off")
        >>> ckptstream.save(state, "ckpt.safetensors", settings=big)
    """

    buffer_size: int
    num_buffers: int
    io_threads: int
    direct_io: DirectIO
    hot_io_threads: int
    s3_timeout: float
    s3_min_rate: int

    # Defaults from the staging sweep (docs/benchmarks.md); the object store's: a healthy store
    # starts an answer within a second, and a request of a 16 MiB part at the least rate, 64 s
    # more, leaves room for 8 such requests sharing a 17 Mbit/s link.
    def __init__(self, buffer_size: int = 16 * MiB, num_buffers: int = 8, io_threads: int = 8,
                 direct_io: DirectIO | str | bool | None = DirectIO.AUTO, hot_io_threads: int = 16,
                 s3_timeout: float = 30.0, s3_min_rate: int = 256 << 10) -> None:
        for name, value in (("buffer_size", buffer_size), ("num_buffers", num_buffers), ("io_threads", io_threads),
                            ("hot_io_threads", hot_io_threads), ("s3_min_rate", s3_min_rate)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, value)
        if not isinstance(s3_timeout, int | float) or isinstance(s3_timeout, bool) or not 0 < s3_timeout < math.inf:
            raise ValueError(f"s3_timeout must be a number of seconds > 0, got {s3_timeout!r}")
        object.__setattr__(self, "s3_timeout", float(s3_timeout))
        object.__setattr__(self, "direct_io", DirectIO.parse(direct_io))
        if self.direct_io is DirectIO.ON and self.buffer_size % ALIGN:
            # checked here, before a transfer opens (and maybe truncates) its file
            raise ValueError(f"direct_io='on' needs buffer_size to be a multiple of {ALIGN}, got {self.buffer_size}")


_ENVIRONMENT = {
    "buffer_size": "CKPTSTREAM_BUFFER_SIZE",
    "num_buffers": "CKPTSTREAM_NUM_BUFFERS",
    "io_threads": "CKPTSTREAM_IO_THREADS",
    "direct_io": "CKPTSTREAM_DIRECT_IO",
    "hot_io_threads": "CKPTSTREAM_HOT_IO_THREADS",
    "s3_timeout": "CKPTSTREAM_S3_TIMEOUT",
    "s3_min_rate": "CKPTSTREAM_S3_MIN_RATE",
}
_PARSE: dict[str, Any] = {"direct_io": str, "s3_timeout": float}  # the others: int
_EXPECTED = {"direct_io": "'auto', 'on' or 'off'", "s3_timeout": "a number of seconds > 0"}


def _from_environment() -> Settings:
    return _parse_environment(tuple(os.environ.get(v) for v in _ENVIRONMENT.values()))


@functools.lru_cache(maxsize=4)  # parsed once per distinct environment
def _parse_environment(values: tuple[str | None, ...]) -> Settings:
    """The defaults with the ``CKPTSTREAM_*`` variables that are set."""
    given: dict[str, Any] = {}
    for (field, variable), raw in zip(_ENVIRONMENT.items(), values, strict=True):
        if raw is None:
            continue
        try:
            given[field] = _PARSE.get(field, int)(raw)
            Settings(**{field: given[field]})
        except ValueError as e:
            expected = _EXPECTED.get(field, "an integer >= 1")
            raise ValueError(f"environment variable {variable}={raw!r} is invalid: expected {expected}; "
                             f"fix or unset it") from e
    return Settings(**given)


_current: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("ckptstream_settings", default=None)


def current_settings() -> Settings:
    """The settings in force in this thread / context (the environment's, unless overridden)."""
    return _current.get() or _from_environment()


class SettingsFields(TypedDict, total=False):
    """The fields of Settings, as ``ckptstream.settings(...)`` takes them."""

    buffer_size: int
    num_buffers: int
    io_threads: int
    direct_io: DirectIO | str | bool | None
    hot_io_threads: int
    s3_timeout: float
    s3_min_rate: int


@contextlib.contextmanager
def settings(**overrides: Unpack[SettingsFields]) -> Iterator[Settings]:
    """Override the defaults inside a ``with`` block (this thread / context only).

    Example:
        >>> with ckptstream.settings(buffer_size=64 << 20, num_buffers=2):
        ...     ckptstream.device_to_file(tensor, "t.bin")
    """
    known = [f.name for f in dataclasses.fields(Settings)]
    unknown = set(overrides) - set(known)
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}; known: {known}")
    given: dict[str, Any] = dict(overrides)  # checked by Settings
    token = _current.set(dataclasses.replace(current_settings(), **given))
    try:
        yield current_settings()
    finally:
        _current.reset(token)


class LegacyKeywords(TypedDict, total=False):
    """0.1.0's per-call keywords of ``load``, ``load_into``, ``device_to_file`` and
    ``file_to_device``, which ``settings=`` replaces (accepted, with a DeprecationWarning)."""

    buffer_size: int | None
    num_buffers: int | None


class LegacySaveKeywords(LegacyKeywords, total=False):
    """0.1.0's per-call keywords of ``save``: those of ``LegacyKeywords`` and ``direct_io``."""

    direct_io: DirectIO | str | bool | None


# the deprecated keywords of each function that 0.1.0 released with them; no other call takes any
RELEASED: Final = {
    "save": ("buffer_size", "num_buffers", "direct_io"),
    "load": ("buffer_size", "num_buffers"),
    "load_into": ("buffer_size", "num_buffers"),
    "device_to_file": ("buffer_size", "num_buffers"),
    "file_to_device": ("buffer_size", "num_buffers"),
}


def _reject_unknown(where: str, given: Mapping[str, object]) -> None:
    unknown = [name for name in given if name not in RELEASED.get(where, ())]
    if unknown:  # what Python says for a keyword the signature lacks
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")


def check_settings(settings: object, where: str) -> Settings | None:
    """``settings`` when it is a Settings or None, else a TypeError naming the call."""
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(f"{where}(settings=...) takes a ckptstream.Settings (or None: the settings in force), "
                        f"got {type(settings).__name__}; build one with ckptstream.Settings(buffer_size=..., ...)")
    return settings


def legacy_overrides(where: str, legacy: Mapping[str, object], settings: object = None, *,
                     stacklevel: int = 3) -> dict[str, object]:
    """The deprecated per-call keywords of ``where`` that were given, with a DeprecationWarning
    that names the new way (``settings=`` or the ``with ckptstream.settings(...)`` scope);
    None (as 0.1.0 spelled "inherit") values are dropped. Raises TypeError for
    an unknown keyword, or for the keywords together with ``settings=``."""
    _reject_unknown(where, legacy)
    if not legacy:
        return {}
    names = ", ".join(f"{name}=..." for name in legacy)
    if settings is not None:
        raise TypeError(f"{where}() takes settings= or the deprecated {names}, not both: put them in the Settings")
    warnings.warn(f"{where}({names}) is deprecated: pass settings=ckptstream.Settings({names}) (a complete "
                  "value), or change the settings in force with `with ckptstream.settings(...)`",
                  DeprecationWarning, stacklevel=stacklevel)
    return {name: value for name, value in legacy.items() if value is not None}


def overlay(overrides: Mapping[str, object]) -> Settings:
    """The settings in force with ``overrides`` (the deprecated per-call keywords) applied."""
    base = current_settings()
    return dataclasses.replace(base, **overrides) if overrides else base  # type: ignore[arg-type]


def per_call(where: str, settings: object, legacy: Mapping[str, object]) -> Settings:
    """The settings of one call of the public ``where``: ``settings`` as given (a complete value),
    else the settings in force with the deprecated keywords applied (see ``legacy_overrides``)."""
    given = check_settings(settings, where)
    overrides = legacy_overrides(where, legacy, given, stacklevel=4)
    if given is not None:
        return given
    return overlay(overrides)
