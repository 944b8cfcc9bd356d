"""Which storage a path or URL names: a local path, or ``scheme://...`` served by the storage
registered for that scheme.

A built-in implementation is made by a function of its own (``BUILTIN``) that imports its
module when called: ``import ckptstream`` imports no client library, only the first URL of its
scheme does. Tests register their own (``register``). A scheme that is neither registered nor
built in is looked up in the ``ckptstream.storages`` entry-point group, so that installing a
distribution that declares ``foo = ckptstream_foo:FooStorage`` there adds ``foo://`` URLs (the
entry point names a callable, a ``Storage`` subclass or a function, that makes the storage).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable

from .._errors import UnsupportedStorageError
from .base import Storage


def _s3() -> Storage:
    from .s3 import S3Storage

    return S3Storage()


def _gcs() -> Storage:
    from .gcs import GCSStorage

    return GCSStorage()


def _az() -> Storage:
    from .azure import AzureStorage

    return AzureStorage()


# scheme -> the function that makes its storage, importing its module (and client library) only
# when called
BUILTIN: dict[str, Callable[[], Storage]] = {"s3": _s3, "gs": _gcs, "az": _az}
# what to install for a built-in scheme whose module needs an optional extra (pip install ckptstream[...])
EXTRAS: dict[str, str] = {"s3": "s3", "gs": "gcs", "az": "azure"}

ENTRY_POINTS = "ckptstream.storages"  # the group of third parties' storages, one entry point per scheme
log = logging.getLogger(__name__)

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
    factory = _registered.get(scheme) or BUILTIN.get(scheme) or _entry_point(scheme, url)
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


def _entry_point(scheme: str, url: str) -> Callable[[], Storage] | None:
    """The factory that an installed distribution declares for ``scheme`` (None if none does)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name.lower() == scheme]
    if not found:
        return None
    if len({ep.value for ep in found}) > 1:  # two distributions claim it: refuse to guess
        raise UnsupportedStorageError(f"{url}: several installed distributions declare a storage for {scheme}:// "
                                      f"URLs ({', '.join(sorted(ep.value for ep in found))}); uninstall all but one")
    try:
        factory = found[0].load()
    except Exception as e:  # any error of a third party's import: say whose it is
        raise UnsupportedStorageError(f"{url}: the storage of {scheme}:// URLs ({found[0].value}, entry point "
                                      f"of {ENTRY_POINTS}) cannot be loaded: {e}") from e
    log.debug("%s:// URLs served by %s (entry point)", scheme, found[0].value)
    return factory  # type: ignore[no-any-return]


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
