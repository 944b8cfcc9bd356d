"""Every gs:// request ends within its deadline (``s3_timeout + bytes / s3_min_rate``, the
library's retries included), whatever a stalling server does: the same proxy as S3's
(tests/s3/faultproxy.py) in front of an emulator of this module's own (a stalled request holds
the emulator's one thread: the other tests' emulator stays out of it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckptstream
from ckptstream._storage.gcs import reset_clients
from ckptstream._storage.objsource import FIRST
from tests.gcs.gcsserver import GCSServer, require_emulator
from tests.gcs.gcsutil import Bucket, MiB, new_bucket, use_server
from tests.s3.faultproxy import FaultProxy
from tests.s3.test_s3_deadlines import FAST, RATE, TIMEOUT, fails_in_time, stalls, state

# each stall holds the emulator's one thread for its whole deadline (seconds): make test runs the
# drip (the stall no socket timeout catches) on both operations, the others are marked slow
GCS_STALLS = stalls("drip")


@pytest.fixture(scope="module")
def own_server() -> Iterator[GCSServer]:
    require_emulator()
    server = GCSServer()
    yield server
    server.stop()


@pytest.fixture
def stalled(own_server: GCSServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Bucket,
                                                                                                      FaultProxy]]:
    """A new bucket, which ``gs://`` URLs reach through a proxy."""
    host, port = own_server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), refuse=False)
    try:
        use_server(monkeypatch, tmp_path, {**own_server.env, "STORAGE_EMULATOR_HOST": proxy.endpoint})
        yield new_bucket(own_server), proxy  # (made directly: the raw client does not go through the proxy)
    finally:
        proxy.close()
        reset_clients()


@pytest.mark.parametrize("stall", GCS_STALLS)
def test_a_save_ends_within_its_deadline_and_leaves_the_old_object(stalled: tuple[Bucket, FaultProxy],
                                                                   stall: str) -> None:
    gcs, proxy = stalled
    old = os.urandom(1000)
    gcs.put("a/ckpt", old)
    proxy.stall, proxy.stall_after = stall, 7 * MiB  # once some parts are up
    with ckptstream.settings(buffer_size=5 * MiB, **FAST):  # type: ignore[arg-type]
        error = fails_in_time(lambda: ckptstream.save(state(), gcs.url("a/ckpt")))
    assert proxy.mode == stall
    assert error.url == gcs.url("a/ckpt")
    assert f"s3_timeout {TIMEOUT} s" in str(error)
    proxy.close()
    assert gcs.get("a/ckpt") == old
    assert gcs.keys() == ["a/ckpt"]


@pytest.mark.parametrize("stall", GCS_STALLS)
def test_a_load_ends_within_its_deadline(stalled: tuple[Bucket, FaultProxy], stall: str) -> None:
    gcs, proxy = stalled
    ckptstream.save(state(), gcs.url("ckpt"))
    proxy.mode = stall
    with ckptstream.settings(**FAST):  # type: ignore[arg-type]
        error = fails_in_time(lambda: ckptstream.load(gcs.url("ckpt")))
    assert error.url == gcs.url("ckpt")
    assert error.operation in ("opening the object", f"reading bytes 0..{FIRST}")
    assert error.deadline == pytest.approx(TIMEOUT + FIRST / RATE)
