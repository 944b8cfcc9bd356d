"""Kill-and-resume through torchtitan's own entry point (``torchtitan.train``) on a CPU: its
llama3 debug model (tests/resume/titan_configs.py) trained for STEPS steps with
``--checkpoint.enable --checkpoint.interval 3 --checkpoint.async_mode async`` through
``ckptstream.torchtitan.StreamCheckpointManager`` (device staging, in the background), killed with
SIGKILL at seeded random steps (while a save may still write), resumed by torchtitan's own resume
(the same command, the same checkpoint folder); its losses and final state are bit-equal to an
uninterrupted run's, and torchtitan's own saver side by side gives the same losses. The kill points
are reached by reading the child's output: no timing. On a CPU the runs are forked from a server
that has imported torchtitan once (tests/resume/titan_server.py); on a GPU each is started anew."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream.dcp
from tests.resume.titan_assets import make_assets

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None
                                or importlib.util.find_spec("triton") is None,
                                reason="needs torchtitan and triton (torchtitan's trainer imports it)")

RESUME = Path(__file__).parent / "resume"
CHILD, SERVER = RESUME / "child_torchtitan.py", RESUME / "titan_server.py"
STEPS, EVERY = 24, 3


class Server:
    """The fork server: one process that imported torchtitan, forking each run."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)
        assert self.said() == ["ready"]

    def said(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the fork server ended (status {self.proc.wait()})"
        return line.split()

    def ask(self, verb: str, what: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{verb} {what}\n")
        self.proc.stdin.flush()
        return self.said()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Forked:
    """A run forked by the server, seen as the test sees a ``Popen``: ``stdout``, ``send_signal``,
    ``kill``, ``communicate`` and ``returncode``."""

    def __init__(self, server: Server, dump: Path, env: dict[str, str], args: list[str]) -> None:
        fifo = dump / f"stdout-{len(list(dump.glob('stdout-*')))}"
        os.mkfifo(fifo)
        request = {"fifo": str(fifo), "cwd": str(dump), "env": env, "args": args}
        word, pid = server.ask("run", json.dumps(request))
        assert word == "started"
        self.server, self.pid = server, int(pid)
        self.returncode: int | None = None
        self.stdout = open(fifo)  # noqa: SIM115 (closed by communicate); the child opens it first

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        if self.returncode is not None:
            return "", None
        out = self.stdout.read()
        self.stdout.close()
        word, _, status = self.server.ask("wait", str(self.pid))
        assert word == "exit"
        self.returncode = os.waitstatus_to_exitcode(int(status))
        return out, None


SERVERS: list[Server] = []  # the one of the running test, where runs are forked


@contextlib.contextmanager
def launcher() -> Iterator[None]:
    """Runs forked from a server that imported torchtitan, on a machine without a GPU."""
    if torch.cuda.is_available():
        yield
        return
    SERVERS.append(Server(child_env()))
    try:
        yield
    finally:
        SERVERS.pop().close()


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}


def start(dump: Path, assets: Path, config: str, extra: tuple[str, ...] = ()) -> Any:
    dump.mkdir(parents=True, exist_ok=True)
    env = {**child_env(), "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["--module", "titan_configs", "--config", config, "--training.steps", str(STEPS),
            "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "text"),
            "--checkpoint.enable", "--checkpoint.interval", str(EVERY), "--checkpoint.async_mode", "async",
            "--dump_folder", str(dump), *extra]
    if SERVERS:
        return Forked(SERVERS[-1], dump, env, args)
    return subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, cwd=dump)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def losses(lines: list[str]) -> dict[int, str]:
    return {int(line.split()[1]): line.split()[2] for line in lines if line.startswith("step ")}


def first_word(lines: list[str]) -> int:
    """The step the run resumed from (0 for a fresh start)."""
    line = next(line for line in lines if line.startswith(("resumed ", "fresh")))
    return int(line.split()[1]) if line.startswith("resumed") else 0


def run_whole(dump: Path, assets: Path, configs: tuple[str, ...], extra: tuple[str, ...] = ()) -> list[list[str]]:
    """Run the child once per config at the same time (each in a folder of its own): their lines."""
    children = [start(dump / config, assets, config, extra) for config in configs]
    outputs = []
    try:
        for child in children:
            out, _ = child.communicate(timeout=600)
            assert child.returncode == 0, out[-3000:]
            outputs.append(out.splitlines())
    finally:
        for child in children:
            child.kill()
            child.communicate()
    return outputs


def run_killed(dump: Path, assets: Path, chooser: random.Random,
               extra: tuple[str, ...] = ()) -> tuple[int, int, dict[int, str]]:
    """Start the child, pick a step past the one it resumed from, SIGKILL it once it prints that
    step (it may have run a little further): (resumed from, killed at, its losses)."""
    child = start(dump, assets, "cpu_stream", extra)
    assert child.stdout is not None
    lines: list[str] = []
    step = None
    try:
        for line in child.stdout:
            lines.append(line)
            if line.startswith(("resumed ", "fresh")):
                resumed = first_word(lines)
                step = chooser.randint(resumed + 1, min(STEPS - 1, resumed + 2 * EVERY))
            if step is not None and line.startswith(f"step {step} "):
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, lines[-5:]
    return first_word(lines), step or 0, losses(lines)


def lowest_resume(killed_at: int) -> int:
    """The earliest step a run killed once it printed ``killed_at`` may resume from: the save before
    the last one begun (one async save runs at a time: the next waits for it)."""
    return max(0, ((killed_at - 1) // EVERY) * EVERY - EVERY)


def final_state(folder: Path, stream: bool) -> dict[str, object]:
    out = folder.parent / f"{folder.parent.parent.name}-{folder.name}.pt"
    if stream:
        ckptstream.dcp.dcp_to_torch_save(folder, out)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(folder, out)
    return dict(torch.load(out, weights_only=False))


def tensors(state: dict[str, object], prefix: str = "") -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            found[prefix + key] = value
        elif isinstance(value, dict):
            found.update(tensors(value, f"{prefix}{key}."))
    return found


@pytest.mark.timeout(1500)  # eight runs of torchtitan, each spending most of its time importing
def test_killed_torchtitan_runs_resume_bit_for_bit(tmp_path: Path) -> None:
    kill_and_resume(tmp_path)


def kill_and_resume(tmp_path: Path, extra: tuple[str, ...] = ()) -> None:
    """The test, with ``extra`` arguments for every run of torchtitan (tests/test_torchtitan_gpu.py)."""
    with launcher():
        runs_and_checks(tmp_path, extra)


def runs_and_checks(tmp_path: Path, extra: tuple[str, ...]) -> None:
    assets = tmp_path / "assets"
    make_assets(assets)
    whole, default = run_whole(tmp_path, assets, ("cpu_stream", "cpu_debugmodel"), extra)
    assert "fresh" in whole
    assert len(losses(whole)) == STEPS
    assert losses(default) == losses(whole)  # torchtitan's own saver, side by side: the same losses
    reference = losses(whole)
    chooser, dump, killed_at = random.Random(7), tmp_path / "killed" / "cpu_stream", 0
    for _ in range(5):
        resumed, step, seen = run_killed(dump, assets, chooser, extra)
        assert resumed % EVERY == 0, resumed
        assert resumed >= lowest_resume(killed_at), (killed_at, resumed)
        assert seen == {s: reference[s] for s in seen}, (step, resumed)  # every step it ran, also those run again
        killed_at = step
    (lines,) = run_whole(tmp_path / "killed", assets, ("cpu_stream",), extra)
    resumed = first_word(lines)
    assert resumed % EVERY == 0
    assert resumed >= lowest_resume(killed_at)
    assert losses(lines) == {s: reference[s] for s in range(resumed + 1, STEPS + 1)}
    last = f"step-{STEPS}"
    mine = tensors(final_state(dump / "checkpoint" / last, stream=True))
    theirs = tensors(final_state(tmp_path / "cpu_stream" / "checkpoint" / last, stream=True))
    torchtitans = tensors(final_state(tmp_path / "cpu_debugmodel" / "checkpoint" / last, stream=False))
    assert sorted(mine) == sorted(theirs) == sorted(torchtitans)
    assert any(key.startswith("optimizer.") for key in mine)
    assert "tok_embeddings.weight" in mine
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
        assert torch.equal(mine[key], torchtitans[key]), key
    for folder in sorted((dump / "checkpoint").iterdir()):
        if (folder / ckptstream.dcp.METADATA_NAME).exists():
            cli = subprocess.run([sys.executable, "-m", "ckptstream", "verify", str(folder)], capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            assert cli.returncode == 0, cli.stdout + cli.stderr
