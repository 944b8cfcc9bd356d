"""Deadlines on az:// URLs: a store that freezes, sends its headers and then nothing, or drips a
byte at a time (a proxy in front of Azurite) fails a save or a read with DeadlineExceededError
within its deadline, naming the URL; the old blob stays."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream._storage import storage_for
from tests.azure.azutil import Container, MiB, azure, azure_server, use_server  # noqa: F401
from tests.helpers import random_tensor
from tests.s3.faultproxy import FaultProxy
from tests.s3.test_s3_deadlines import FAST, RATE, TIMEOUT, fails_in_time, stalls

STORE = storage_for("az://any")


@pytest.fixture
def proxy(azure: Container, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FaultProxy]:
    """A proxy in front of Azurite, which ``az://`` URLs reach through."""
    host_port = azure.server.endpoint.removeprefix("http://").split("/")[0]
    host, port = host_port.split(":")
    proxy = FaultProxy((host, int(port)), refuse=False)
    try:
        conn = azure.server.connection_string.replace(host_port, f"127.0.0.1:{proxy.port}")
        use_server(monkeypatch, tmp_path, {"AZURE_STORAGE_CONNECTION_STRING": conn})
        yield proxy
    finally:
        proxy.close()


@pytest.mark.parametrize("stall", stalls("drip"))
def test_a_save_ends_within_its_deadline_and_leaves_the_old_blob(azure: Container, proxy: FaultProxy,
                                                                 stall: str) -> None:
    old = os.urandom(1000)
    azure.put("a/ckpt", old)
    proxy.stall, proxy.stall_after = stall, 5 * MiB  # once some blocks are up
    state = {"big": random_tensor((3 * MiB,), torch.float32), "small": random_tensor((100,), torch.float16)}
    with ckptstream.settings(buffer_size=2 * MiB, **FAST):  # type: ignore[arg-type]
        error = fails_in_time(lambda: ckptstream.save(state, azure.url("a/ckpt")))
    assert error.url == azure.url("a/ckpt")
    assert error.operation.startswith(("uploading part", "completing the upload"))
    assert TIMEOUT <= error.deadline <= TIMEOUT + 12 * MiB / RATE
    assert azure.get("a/ckpt") == old
    assert azure.keys() == ["a/ckpt"]


@pytest.mark.parametrize("stall", stalls("headers"))
def test_a_ranged_read_ends_within_its_deadline(azure: Container, proxy: FaultProxy, stall: str) -> None:
    data = os.urandom(4 * MiB)
    azure.put("r", data)
    out = bytearray(len(data) - MiB)
    with ckptstream.settings(**FAST), STORE.open(azure.url("r")) as source:  # type: ignore[arg-type]
        proxy.mode = stall
        error = fails_in_time(lambda: source.read_into(memoryview(out), MiB))
    assert error.operation == f"reading bytes {MiB}..{len(data)}"
    assert f"az://{azure.name}/r" in str(error)
    proxy.mode = "pass"
    with STORE.open(azure.url("r")) as source:  # nothing of the store is left broken
        assert source.read_into(memoryview(out), MiB) == len(out)
    assert out == data[MiB:]
