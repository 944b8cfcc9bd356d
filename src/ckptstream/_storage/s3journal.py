"""Which multipart uploads this host's writers have in flight: one small file per upload, so
that a later writer of the same key can tell an upload whose writer died (its process is gone)
from one still being written, as local temp names do with their host and pid.

An object store lists an upload's key, id and start time, nothing of its writer; the journal
adds that, on the writer's host. Uploads of writers elsewhere are told stale by age alone.
Journal trouble (a read-only home) never fails a save: such an upload is then known by age only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterator

from .publish import pid_namespace, process_alive


def directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptstream", "s3-uploads")


def _digest(bucket: str, key: str, upload_id: str) -> str:
    """The name of an upload's note, after its writer's: an upload id is unique in its store."""
    return hashlib.sha256("\0".join((bucket, key, upload_id)).encode()).hexdigest()[:24] + ".json"


def record(endpoint: str, bucket: str, key: str, upload_id: str) -> None:
    """Note an upload this process has started."""
    entry = {"endpoint": endpoint, "bucket": bucket, "key": key, "upload_id": upload_id,
             "host": socket.gethostname(), "ns": pid_namespace(), "pid": os.getpid()}
    with contextlib.suppress(OSError):
        os.makedirs(directory(), exist_ok=True)
        name = f"{socket.gethostname()}-{pid_namespace()}-{os.getpid()}-{_digest(bucket, key, upload_id)}"
        path = os.path.join(directory(), name)
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(path + ".part", path)


def forget(bucket: str, key: str, upload_id: str) -> None:
    """The upload is completed or aborted: drop its note (also another, dead process's)."""
    folder, digest = directory(), _digest(bucket, key, upload_id)
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.endswith(digest):
                os.unlink(os.path.join(folder, name))


def _entries() -> Iterator[dict[str, object]]:
    folder = directory()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.endswith(".json"):
            continue
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                entry = json.load(f)
            if isinstance(entry, dict):
                yield entry


def dead_writers(bucket: str, key: str, live: Callable[[], set[str]]) -> set[str]:
    """The ids of the uploads of ``key`` whose writers were on this host, in this PID namespace,
    and are certainly gone: another process that no longer exists, or this process, where the
    upload is not among ``live()`` (its own in flight), asked for once the notes are read (an
    upload is live before its note is written, so a note read names an upload that ``live()``
    then holds while in flight)."""
    host, ns, me = socket.gethostname(), pid_namespace(), os.getpid()
    mine, dead = set(), set()
    for e in _entries():
        if (e.get("bucket"), e.get("key")) != (bucket, key):
            continue  # (any endpoint's: an id names an upload only in the store that lists it)
        upload, pid = e.get("upload_id"), e.get("pid")
        if not isinstance(upload, str) or not isinstance(pid, int) or e.get("host") != host or e.get("ns") != ns:
            continue
        if pid == me:
            mine.add(upload)
        elif not process_alive(pid):
            dead.add(upload)
    return dead | (mine - live()) if mine else dead
