"""Which storage a path or URL names: a local path, or ``scheme://...`` served by the storage
registered for that scheme.

An implementation registers itself lazily, by the name of the module that makes it
(``BUILTIN``), so that ``import ckptstream`` imports no client library: only the first URL of
its scheme does. Tests register their own (``register``).
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from collections.abc import Callable

from .._errors import UnsupportedStorageError
from .base import Storage

# scheme -> "module:factory", imported on the first URL of the scheme; an object store's
# implementation adds its line here (e.g. "s3": "ckptstream._storage.s3:S3Storage")
BUILTIN: dict[str, str] = {}
# what to install for a built-in scheme, where its module needs an optional extra
EXTRAS: dict[str, str] = {}

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_factories: dict[str, Callable[[], Storage]] = {}
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
            made = _made[scheme] = _factory(scheme, os.fsdecode(target))()
        return made


def _factory(scheme: str, url: str) -> Callable[[], Storage]:
    if scheme in _factories:
        return _factories[scheme]
    if scheme not in BUILTIN:
        known = sorted({*_factories, *BUILTIN})
        raise UnsupportedStorageError(
            f"{url}: no storage for {scheme}:// URLs; ckptstream reads and writes local paths"
            + (f" and URLs of {', '.join(f'{k}://' for k in known)}" if known else "")
            + ": give a local path, or a URL of one of those")
    module, _, name = BUILTIN[scheme].partition(":")
    try:
        factory: Callable[[], Storage] = getattr(importlib.import_module(module), name)
    except ImportError as e:
        extra = EXTRAS.get(scheme)
        hint = f"install it with pip install 'ckptstream[{extra}]'" if extra else "its module is missing"
        raise UnsupportedStorageError(f"{url}: the storage of {scheme}:// URLs cannot be loaded ({e}); {hint}") from e
    _factories[scheme] = factory
    return factory


def register(scheme: str, factory: Callable[[], Storage] | None) -> None:
    """Serve ``scheme://`` URLs with the storage ``factory()`` makes (on the first such URL);
    None removes the registration (built-in schemes then load their own again)."""
    if not _SCHEME.fullmatch(f"{scheme}://"):
        raise ValueError(f"{scheme!r} is not a URL scheme (a letter, then letters, digits, '+', '-' or '.')")
    key = scheme.lower()
    with _lock:
        _made.pop(key, None)
        if factory is None:
            _factories.pop(key, None)
        else:
            _factories[key] = factory
