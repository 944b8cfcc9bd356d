"""Counts the requests a ``gs://`` storage's client sends (every call of the library, and the
adapter's own uploads and ranged GETs, goes through its session's ``request``), by kind."""

from __future__ import annotations

import collections
import contextlib
import urllib.parse
from collections.abc import Iterator
from typing import Any

from ckptstream._storage import storage_for


def kind(method: str, url: str) -> str:
    path = urllib.parse.urlsplit(url).path
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    if path.startswith("/upload/"):
        return "upload"
    if path.startswith("/download/"):
        return "download"
    if path.startswith("/batch/"):
        return "batch"
    if path.endswith("/compose"):
        return "compose"
    if method == "GET" and path.endswith("/o"):
        return "list"
    if method == "GET" and "alt" in query:
        return "download"
    return f"{method} {'object' if '/o/' in path else 'bucket'}"


@contextlib.contextmanager
def counted(url: str = "gs://any") -> Iterator[collections.Counter[str]]:
    session: Any = storage_for(url).client().gcs._http  # type: ignore[attr-defined]
    sent: collections.Counter[str] = collections.Counter()
    plain = session.request

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        sent[kind(method, url)] += 1
        return plain(method, url, *args, **kwargs)

    session.request = request
    try:
        yield sent
    finally:
        del session.request
