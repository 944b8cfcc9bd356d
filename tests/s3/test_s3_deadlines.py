"""Every request to an object store ends within its deadline (``s3_timeout`` plus its bytes at
``s3_min_rate``, retries included), whatever a stalling server does (tests/s3/faultproxy.py:
freeze, headers and then silence, a drip that no socket timeout catches): a save, a load and a
ranged read fail with ``DeadlineExceededError`` naming the URL, the operation and the deadline,
and a failed save leaves the old object. Small deadlines are set through the settings; the
only bound on time asserted is a generous one (30 s against deadlines of about 5 s)."""

from __future__ import annotations

import contextvars
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._settings import _parse_environment
from ckptstream._storage import storage_for
from ckptstream._storage.s3 import FIRST
from tests.helpers import random_tensor
from tests.s3.faultproxy import FaultProxy
from tests.s3.s3util import Bucket, MiB, s3, s3_server, use_server  # noqa: F401

STORE = storage_for("s3://any")
BOUND = 30.0  # seconds: about twice the deadlines below (a save's abort has its own); a stalled request
# without a deadline waits for botocore's socket timeout (60 s), once per attempt
STALLS = ["freeze", "headers", "drip"]


def stalls(quick: str) -> list[Any]:
    """STALLS for one operation's test, all but ``quick`` marked slow: ``make test`` meets every
    kind of stall on each store, each on one of its operations (each wait is a whole deadline);
    ``-m slow`` runs the rest."""
    return [pytest.param(s, marks=() if s == quick else pytest.mark.slow) for s in STALLS]

TIMEOUT, RATE = 5, 16 * MiB  # deadlines of 5 s and a little per MiB: room for a busy machine before the stall
FAST = {"s3_timeout": TIMEOUT, "s3_min_rate": RATE}


@pytest.fixture
def proxy(s3: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FaultProxy]:
    """A proxy in front of the test server, which ``s3://`` URLs reach through."""
    host, port = s3.server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), refuse=False)
    try:
        use_server(monkeypatch, tmp_path, {**s3.server.env, "AWS_ENDPOINT_URL": proxy.endpoint})
        yield proxy
    finally:
        proxy.close()


def fails_in_time(call: Callable[[], Any]) -> ckptstream.DeadlineExceededError:
    """The DeadlineExceededError ``call`` raises, within BOUND seconds; run in a thread (with the
    caller's settings), so that a call that never returns fails the test instead of hanging it
    (the proxy's close ends it)."""
    context = contextvars.copy_context()
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            context.run(call)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"still running after {BOUND} s"
    (error,) = outcome
    assert isinstance(error, ckptstream.DeadlineExceededError), repr(error)
    assert isinstance(error, ckptstream.ConnectionLostError)
    assert isinstance(error, TimeoutError)
    return error


def state() -> dict[str, torch.Tensor]:
    return {"big": random_tensor((3 * MiB,), torch.float32), "small": random_tensor((100,), torch.float16)}


@pytest.mark.parametrize("stall", stalls("drip"))
def test_a_save_ends_within_its_deadline_and_leaves_the_old_object(s3: Bucket, proxy: FaultProxy,
                                                                   stall: str) -> None:
    old = os.urandom(1000)
    s3.put("a/ckpt", old)
    proxy.stall, proxy.stall_after = stall, 7 * MiB  # once some parts are up
    with ckptstream.settings(buffer_size=5 * MiB, **FAST):  # type: ignore[arg-type]
        error = fails_in_time(lambda: ckptstream.save(state(), s3.url("a/ckpt")))
    assert proxy.mode == stall
    assert error.url == s3.url("a/ckpt")
    assert error.operation.startswith(("uploading part", "completing the upload", "starting"))
    assert TIMEOUT <= error.deadline <= TIMEOUT + 12 * MiB / RATE  # a part, or the object assembled
    assert f"{error.operation} did not end within its deadline of {error.deadline:.1f} s" in str(error)
    assert f"s3_timeout {TIMEOUT} s" in str(error)
    assert s3.get("a/ckpt") == old
    assert s3.keys() == ["a/ckpt"]


@pytest.mark.parametrize("stall", stalls("headers"))
def test_a_load_ends_within_its_deadline(s3: Bucket, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
                                         stall: str) -> None:
    ckptstream.save(state(), s3.url("ckpt"))
    monkeypatch.setenv("CKPTSTREAM_S3_TIMEOUT", str(TIMEOUT))  # the environment's, this time
    monkeypatch.setenv("CKPTSTREAM_S3_MIN_RATE", str(RATE))
    proxy.mode = stall
    error = fails_in_time(lambda: ckptstream.load(s3.url("ckpt")))
    assert error.url == s3.url("ckpt")
    # the opening, or the read of its first MiB that follows where the opening's body ran into
    # the socket timeout (s3_timeout) just before its deadline (a little more)
    assert error.operation in ("opening the object", f"reading bytes 0..{FIRST}")
    assert error.deadline == pytest.approx(TIMEOUT + FIRST / RATE)
    assert str(error).startswith(f"[Errno 110] {error.operation} did not end within its deadline of "
                                 f"{TIMEOUT + FIRST / RATE:.1f} s")
    assert "CKPTSTREAM_S3_TIMEOUT" in str(error)


@pytest.mark.parametrize("stall", stalls("freeze"))
def test_a_ranged_read_ends_within_its_deadline(s3: Bucket, proxy: FaultProxy, stall: str) -> None:
    data = os.urandom(6 * MiB)
    s3.put("r", data)
    out = bytearray(len(data) - FIRST)
    with ckptstream.settings(**FAST), STORE.open(s3.url("r")) as source:  # type: ignore[arg-type]
        proxy.mode = stall
        error = fails_in_time(lambda: source.read_into(memoryview(out), FIRST))
    assert error.operation == f"reading bytes {FIRST}..{len(data)}"
    assert error.deadline == pytest.approx(TIMEOUT + len(out) / RATE)
    assert f"s3://{s3.name}/r" in str(error)
    proxy.mode = "pass"
    with STORE.open(s3.url("r")) as source:  # nothing of the store is left broken
        assert source.read_into(memoryview(out), FIRST) == len(out)
    assert out == data[FIRST:]


def test_listings_and_removals_end_within_their_deadlines(s3: Bucket, proxy: FaultProxy) -> None:
    s3.put("run/step-1/state", b"x")
    proxy.mode = "freeze"
    with ckptstream.settings(**FAST):  # type: ignore[arg-type]
        for call, operation in ((lambda: STORE.list_folder(s3.url("run")), "listing the folder"),
                                (lambda: STORE.remove_tree(s3.url("run/step-1")), "listing the folder to remove"),
                                (lambda: STORE.size(s3.url("run/step-1/state")), "looking at the object")):
            error = fails_in_time(call)
            assert error.operation == operation
            assert error.deadline == TIMEOUT


def test_the_settings_and_their_environment() -> None:
    assert (ckptstream.Settings().s3_timeout, ckptstream.Settings().s3_min_rate) == (30.0, 256 << 10)
    for bad in (0, -1, math.inf, math.nan, True, "2"):
        with pytest.raises(ValueError, match=r"s3_timeout must be a number of seconds > 0"):
            ckptstream.Settings(s3_timeout=bad)  # type: ignore[arg-type]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"s3_min_rate must be an integer >= 1"):
            ckptstream.Settings(s3_min_rate=bad)  # type: ignore[arg-type]
    names = list(ckptstream._settings._ENVIRONMENT.values())
    values = tuple({"CKPTSTREAM_S3_TIMEOUT": "2.5", "CKPTSTREAM_S3_MIN_RATE": "1000"}.get(n) for n in names)
    assert (_parse_environment(values).s3_timeout, _parse_environment(values).s3_min_rate) == (2.5, 1000)
    values = tuple({"CKPTSTREAM_S3_TIMEOUT": "soon"}.get(n) for n in names)
    with pytest.raises(ValueError, match=r"CKPTSTREAM_S3_TIMEOUT='soon' is invalid: expected a number of seconds"):
        _parse_environment(values)
