"""Storage: the seam under the engine. Everything above it reads and writes through these
interfaces; local files are the first implementation (``local``), and ``storage_for`` picks the
implementation a path or URL names. See ``base`` for the interfaces."""

from .base import Entry, Kind, Lock, LockHeldError, Region, Sink, Source, Storage, Target, round_down, round_up
from .dispatch import register, scheme_of, storage_for

__all__ = [
    "Entry",
    "Kind",
    "Lock",
    "LockHeldError",
    "Region",
    "Sink",
    "Source",
    "Storage",
    "Target",
    "register",
    "round_down",
    "round_up",
    "scheme_of",
    "storage_for",
]
