"""Which storage a path or URL names: a local path, or ``scheme://...`` served by the storage
registered for that scheme.

A built-in implementation is made by a function of its own (``BUILTIN``) that imports its
module when called: ``import ckptstream`` imports no client library, only the first URL of its
scheme does. Tests register their own (``register``).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

from .._errors import UnsupportedStorageError
from .base import Storage


def _s3() -> Storage:
    from .s3 import S3Storage

    return S3Storage()


# scheme -> the function that makes its storage, importing its module (and client library) only
# when called
BUILTIN: dict[str, Callable[[], Storage]] = {"s3": _s3}
# what to install for a built-in scheme whose module needs an optional extra (pip install ckptstream[...])
EXTRAS: dict[str, str] = {"s3": "s3"}

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_registered: dict[str, Callable[[], Storage]] = {}
_made: dict[str, Storage] = {}
_lock = threading.Lock()


def scheme_of(target: str | os.PathLike[str] | bytes) -> str | None:
    """The URL scheme of ``target`` (lower case), None for a local path."""
    m = _SCHEME.match(os.fsdecode(target))
    return m.group(1).lower() if m else None


def storage_for(target: str | os.PathLike[str] | bytes) -> Storage:
    """The storage of a local path or a URL (``s3://bucket/key``, once registered).

    Raises:
        UnsupportedStorageError: a URL of a scheme no storage is registered for (or whose
            implementation cannot be imported), naming the URL and what to do.
    """
    scheme = scheme_of(target)
    if scheme is None:
        from .local import LOCAL

        return LOCAL
    with _lock:
        made = _made.get(scheme)
        if made is None:
            made = _made[scheme] = _make(scheme, os.fsdecode(target))
        return made


def _make(scheme: str, url: str) -> Storage:
    factory = _registered.get(scheme) or BUILTIN.get(scheme)
    if factory is None:
        known = sorted({*_registered, *BUILTIN})
        raise UnsupportedStorageError(
            f"{url}: no storage for {scheme}:// URLs; ckptstream reads and writes local paths"
            + (f" and URLs of {', '.join(f'{k}://' for k in known)}" if known else "")
            + ": give a local path, or a URL of one of those")
    try:
        return factory()
    except ImportError as e:
        extra = EXTRAS.get(scheme)
        hint = f"install it with pip install 'ckptstream[{extra}]'" if extra else "its module is missing"
        raise UnsupportedStorageError(f"{url}: the storage of {scheme}:// URLs cannot be loaded ({e}); {hint}") from e


def register(scheme: str, factory: Callable[[], Storage] | None) -> None:
    """Serve ``scheme://`` URLs with the storage ``factory()`` makes (on the first such URL);
    None removes the registration (a built-in scheme then makes its own again)."""
    if not _SCHEME.fullmatch(f"{scheme}://"):
        raise ValueError(f"{scheme!r} is not a URL scheme (a letter, then letters, digits, '+', '-' or '.')")
    key = scheme.lower()
    with _lock:
        _made.pop(key, None)
        if factory is None:
            _registered.pop(key, None)
        else:
            _registered[key] = factory
