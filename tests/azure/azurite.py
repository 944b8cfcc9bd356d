"""A real Azure Blob Storage emulator for the tests: Azurite's blob service (npm ``azurite``,
installed by the Makefile's set-up under .venv/azurite) on 127.0.0.1, a port the OS picks, its
blobs in memory, the well-known development account ``devstoreaccount1``.

The server dies with the test process (PR_SET_PDEATHSIG) even when pytest itself is killed;
``stop`` ends it otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.s3.s3server import _die_with_parent

ACCOUNT = "devstoreaccount1"
# Azurite's documented development key (public: it opens only the emulator)
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
FLAGS = ("--inMemoryPersistence", "--skipApiVersionCheck", "--loose", "--disableTelemetry", "--silent")
_LISTENING = re.compile(r"listens on (http://127\.0\.0\.1:\d+)")
_ROOT = Path(__file__).resolve().parents[2]


def azurite() -> str | None:
    """The azurite-blob script: $AZURITE, else the one the Makefile installs (.venv/azurite of the
    checkout, or beside this Python), else on PATH."""
    given = os.environ.get("AZURITE")
    if given:
        return given
    for base in (_ROOT / ".venv", Path(sys.prefix)):
        found = base / "azurite" / "node_modules" / ".bin" / "azurite-blob"
        if os.access(found, os.X_OK):
            return str(found)
    return shutil.which("azurite-blob")


class AzuriteServer:
    """One Azurite blob service; ``env`` is the connection string that reaches it."""

    def __init__(self, *flags: str) -> None:
        binary = azurite()
        if binary is None:
            raise RuntimeError("Azurite is not installed: make test installs it (npm install azurite)")
        self.root = tempfile.mkdtemp(prefix="ckptstream-azurite-")  # its working directory; blobs in memory
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [binary, "--blobHost", "127.0.0.1", "--blobPort", "0", *FLAGS, *flags], cwd=self.root,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=_die_with_parent)
        try:
            self.endpoint = self._wait_listening() + "/" + ACCOUNT
        except BaseException:
            self.stop()
            raise
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()

    def _wait_listening(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # it says where it listens once it does (--silent keeps this line)
            self.log.append(line)
            m = _LISTENING.search(line)
            if m:
                return m.group(1)
        raise RuntimeError("Azurite exited before listening:\n" + "".join(self.log))

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # kept read: a full pipe would stall the server
            self.log.append(line)

    @property
    def connection_string(self) -> str:
        return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={self.endpoint};"

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def raw(self) -> Any:
        """A plain azure-storage-blob service client of the emulator (what a person inspecting the
        account would use)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def stop(self) -> None:
        """End the server and remove its workspace; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.root, ignore_errors=True)


_shared: dict[str, Any] = {"server": None, "users": 0}
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_server() -> Iterator[AzuriteServer]:
    """The test session's server: started by its first user, stopped when the last one is done."""
    with _shared_lock:
        if _shared["server"] is None:
            _shared["server"] = AzuriteServer()
        _shared["users"] += 1
        server: AzuriteServer = _shared["server"]
    try:
        yield server
    finally:
        with _shared_lock:
            _shared["users"] -= 1
            if _shared["users"] == 0:
                _shared["server"] = None
                server.stop()


def require_azurite() -> None:
    """Skip where Azurite is missing, except in CI, where its absence is a failure."""
    if azurite() is None:
        if os.environ.get("CI"):
            pytest.fail("Azurite is not installed: the Makefile's set-up installs it (npm install azurite)")
        pytest.skip("Azurite is not installed (npm install --prefix .venv/azurite azurite)")
