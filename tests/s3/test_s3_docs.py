"""docs/object-stores.md's local try-out (the block marked ``<!-- runs in
tests/s3/test_s3_docs.py -->``) runs as written: its ``rclone serve s3`` line starts a server
that its AWS variables reach and its Python line saves to and loads from. Changed only where
the machine differs: the folder lies in tmp_path, the port is a free one, the packages are
already installed (the ``pip install`` line is left out), and the client's lines start once the
server listens."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

import ckptstream
from tests.helpers import child_env
from tests.s3.s3server import _die_with_parent, rclone, require_rclone

ROOT = Path(__file__).resolve().parents[2]
DOC = "docs/object-stores.md"
_BLOCK = re.compile(r"^<!-- runs in tests/s3/test_s3_docs.py -->\n```sh\n(.*?)\n```", re.DOTALL | re.MULTILINE)


def lines(tmp_path: Path, port: int) -> tuple[list[str], str, list[str]]:
    """The block's commands (continuations joined) before the server, the server's, after it."""
    (block,) = _BLOCK.findall((ROOT / DOC).read_text())
    block = block.replace("/tmp/s3-root", str(tmp_path / "s3-root")).replace("8333", str(port))
    commands = re.sub(r"\\\n\s*", "", block).split("\n")
    python = next(i for i, c in enumerate(commands) if c.startswith("python -c"))
    commands[python:] = ["\n".join(commands[python:])]  # a quoted string over several lines
    server = next(i for i, c in enumerate(commands) if c.startswith("rclone serve s3"))
    assert commands[0].startswith("pip install")
    return commands[1:server], commands[server], commands[server + 1 :]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_local_try_out_runs(tmp_path: Path) -> None:
    require_rclone()
    port = free_port()
    before, server, after = lines(tmp_path, port)
    assert server.endswith(" &")
    env = child_env(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"),
                    PATH=os.pathsep.join([os.path.dirname(str(rclone())), os.path.dirname(sys.executable),
                                          os.environ.get("PATH", "")]))
    for name in [n for n in env if n.startswith("AWS_")]:
        del env[name]  # only the block's
    subprocess.run(["bash", "-ec", "\n".join(before)], env=env, check=True, cwd=tmp_path)
    with subprocess.Popen(["bash", "-c", "exec " + server.removesuffix(" &")], env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_die_with_parent) as proc:
        try:
            give_up = time.monotonic() + 120  # a generous bound on a busy machine
            while True:
                assert proc.poll() is None, f"the server exited: {proc.communicate()[1]}"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    break
                except OSError:
                    assert time.monotonic() < give_up, "the server never listened"
                    time.sleep(0.2)
            done = subprocess.run(["bash", "-ec", "\n".join(after)], env=env, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=300)
        finally:
            proc.terminate()
            proc.communicate(timeout=30)
    assert done.returncode == 0, done.stderr
    saved = tmp_path / "s3-root" / "bucket" / "try.safetensors"
    loaded = ckptstream.load(saved)
    assert loaded["w"].shape == (1000,)
    assert done.stdout.strip() == str(loaded["w"][:3])
    assert not torch.equal(loaded["w"], torch.zeros(1000))
