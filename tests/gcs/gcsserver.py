"""A real GCS emulator for the tests: ``gcp-storage-emulator`` (the PyPI package of that name)
on 127.0.0.1, a port the OS picks, its objects in memory.

The emulator runs in a process of its own (started through ``launch_emulator.py``, which says
the port it got), dies with the test process (PR_SET_PDEATHSIG) even when pytest itself is
killed, and ``stop`` ends it otherwise. It serves the JSON API one request at a time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.s3.s3server import _die_with_parent

LAUNCH = Path(__file__).with_name("launch_emulator.py")


def installed() -> bool:
    return importlib.util.find_spec("gcp_storage_emulator") is not None


class GCSServer:
    """One emulator process; ``env`` is the standard configuration that reaches it."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.proc = subprocess.Popen([sys.executable, str(LAUNCH)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
        try:
            self.endpoint = self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()

    def _wait_listening(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("listening on "):
                return line.split()[-1]
        raise RuntimeError("gcp-storage-emulator exited before listening:\n" + "".join(self.log))

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # kept read: a full pipe would stall the server
            self.log.append(line)
            del self.log[:-200]

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GOOGLE_CLOUD_PROJECT": "ckptstream-tests"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_shared: dict[str, Any] = {"server": None, "users": 0}
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_server() -> Iterator[GCSServer]:
    """The test session's emulator: started by its first user, stopped after the last."""
    with _shared_lock:
        if _shared["server"] is None:
            _shared["server"] = GCSServer()
        _shared["users"] += 1
        server: GCSServer = _shared["server"]
    try:
        yield server
    finally:
        with _shared_lock:
            _shared["users"] -= 1
            if _shared["users"] == 0:
                _shared["server"] = None
                server.stop()


def require_emulator() -> None:
    """Skip where the emulator is missing, except in CI, where its absence is a failure."""
    if not installed():
        if os.environ.get("CI"):
            pytest.fail("gcp-storage-emulator is not installed: the [test] extra brings it")
        pytest.skip("gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
