"""A writer killed at any moment of a save never costs the checkpoint already on disk.

Writers are real processes, SIGKILLed at random moments spread over the whole save (data
streaming, the final fsync, the header rewrite and the rename); after each kill the path must
hold one complete checkpoint, old or new, that loads and verifies. Temp files of killed writers
are recognisable by name, and the next save removes them (never one of a live writer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ckptstream
from ckptstream._storage import publish
from tests.helpers import child_env
from tests.reliability.relutil import (
    MiB,
    assert_same_state,
    child_command,
    small_state,
    temp_files,
    temp_name_pattern,
    training_state,
)

BUFFER_SIZE, NUM_BUFFERS = 1 * MiB, 2  # many chunks, so the save has many distinct moments


@dataclasses.dataclass(frozen=True)
class Depth:
    size_mib: int  # big enough that one save takes long enough to be killed at many distinct moments
    trials_per_mode: int  # stratified over the save's duration, in each I/O mode
    commit_trials: int  # aimed at the window between "all data written" and "renamed"
    min_kills: int  # trials are added until this many writers were killed mid-save


# the default run: 32 chunks a save, kills on both sides of the rename; the soak: many more
QUICK, SOAK = Depth(32, 6, 4, 12), Depth(128, 16, 4, 30)


class SaveServer:
    """Drives child_save_server.py: one writer process per request, killed on demand."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.proc = subprocess.Popen(child_command("child_save_server.py", path, size_mib), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=child_env())
        self.lines: queue.Queue[str] = queue.Queue()
        self.pump = threading.Thread(target=self._pump, name="save-server-reader", daemon=True)
        self.pump.start()
        assert self.next_line(timeout=120) == "ready"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def next_line(self, timeout: float = 60) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"the save server said nothing for {timeout} s")
        assert line != "<eof>", f"the save server died (exit status {self.proc.poll()})"
        return line

    def save(self, version: int, direct: str, kill_after: float | None, hold: str = "none") -> dict[str, Any]:
        """One writer saving ``version``; SIGKILLed ``kill_after`` seconds into its save, or
        where it holds (``before_rename`` / ``after_rename``: the writer stops there)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"save {version} {direct} {BUFFER_SIZE} {NUM_BUFFERS} {hold}\n")
        self.proc.stdin.flush()
        tag, pid_text = self.next_line().split()
        assert tag == "start"
        pid = int(pid_text)
        if hold != "none":
            assert self.next_line(timeout=120).split() == ["held", pid_text]
        elif kill_after is not None:
            time.sleep(kill_after)
        if hold != "none" or kill_after is not None:
            with contextlib.suppress(ProcessLookupError):  # it finished and was reaped already
                os.kill(pid, signal.SIGKILL)
        result: dict[str, Any] = {"pid": pid}
        while True:
            words = self.next_line().split(maxsplit=2)
            if words[0] == "done":
                result["timings"] = json.loads(words[2])
            elif words[0] == "exit":
                status = int(words[2])
                result["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                assert result["killed"] or os.WEXITSTATUS(status) == 0, f"writer failed (status {status}); see stderr"
                return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.pump.join(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def schedule(rng: random.Random, timings: dict[str, dict[str, float]], depth: Depth) -> list[tuple[str, float]]:
    """(mode, kill delay): stratified over 0..1.2x each mode's save time, plus some aimed at the
    commit window (data written -> fsync -> header rewrite -> rename) of the buffered mode, where
    the final fsync makes that window long."""
    plan = []
    for mode, t in timings.items():
        span = 1.2 * t["total"]
        plan += [(mode, span * (k + rng.random()) / depth.trials_per_mode) for k in range(depth.trials_per_mode)]
    t = timings["off"]
    lo = t.get("data_written", 0.8 * t["total"])
    plan += [("off", lo + (t["total"] - lo) * (k + rng.random()) / depth.commit_trials)
             for k in range(depth.commit_trials)]
    rng.shuffle(plan)
    return plan


@pytest.mark.parametrize("depth", [QUICK, pytest.param(SOAK, marks=pytest.mark.slow)], ids=["quick", "soak"])
def test_sigkill_at_random_moments_keeps_a_complete_checkpoint(tmp_path: Path, depth: Depth) -> None:
    path = tmp_path / "ckpt.safetensors"
    versions = {v: training_state(v, depth.size_mib * MiB) for v in (0, 1)}
    pattern = temp_name_pattern(path.name)
    rng = random.Random(5)
    server = SaveServer(path, depth.size_mib)
    try:
        # un-killed saves first: the initial checkpoint, and each mode's save duration
        timings = {"auto": server.save(0, "auto", None)["timings"], "off": server.save(1, "off", None)["timings"]}
        current, writers, outcomes = 1, set(), []

        def trial(mode: str, delay: float, hold: str = "none") -> None:
            nonlocal current
            new = 1 - current
            result = server.save(new, mode, delay, hold)
            writers.add(result["pid"])
            # leftovers: recognisable by name, of dead writers only, and never piling up
            temps = temp_files(tmp_path, path.name)
            for name in temps:
                match = pattern.fullmatch(name)
                assert match, f"unexpected file {name}"
                assert int(match.group(1)) in writers, f"unexpected file {name}"
            assert len(temps) <= 1, f"temp files pile up: {temps}"
            # the path holds one complete checkpoint: the previous one or the new one
            ckptstream.verify(path)
            state = ckptstream.load(path)
            version = state["meta"]["version"]
            assert version in (current, new)
            assert result["killed"] or version == new, "a save that returned must have published"
            assert_same_state(state, versions[version])
            outcomes.append((mode if hold == "none" else hold, round(delay, 3), result["killed"],
                             "new" if version == new else "old", len(temps)))
            current = version

        for mode, delay in schedule(rng, timings, depth):
            trial(mode, delay)
        # saves ran faster than when timed (a machine busy then, idle now): aim earlier in them
        while sum(o[2] for o in outcomes) < depth.min_kills and len(outcomes) < 4 * depth.min_kills:
            mode = rng.choice(list(timings))
            trial(mode, rng.uniform(0, 0.6 * timings[mode]["total"]))
        # the two sides of the rename that publishes are the narrowest windows, too narrow to hit
        # by timing on every machine: writers stop there and are killed where they stand
        for mode in timings:
            trial(mode, 0.0, hold="before_rename")
            assert outcomes[-1][2:] == (True, "old", 1), f"killed before its rename: {outcomes[-1]}"
            trial(mode, 0.0, hold="after_rename")
            assert outcomes[-1][2:] == (True, "new", 0), f"killed after its rename: {outcomes[-1]}"
        killed = [o for o in outcomes if o[2]]
        summary = f"timings {timings}; outcomes (mode, delay, killed, path holds, temps left) {outcomes}"
        assert len(killed) >= depth.min_kills, summary
        # an ordinary save removes what the last killed writer left
        assert not server.save(1 - current, "auto", None)["killed"]
        assert temp_files(tmp_path, path.name) == []
        ckptstream.verify(path)
    finally:
        server.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temp_cleanup_spares_live_writers_and_other_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    host = socket.gethostname()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead, live = _dead_pid(), sleeper.pid
        # the name of a temp of this path by a writer of this host, up to its pid and random part
        mine = os.path.basename(publish.temp_path_for(str(path))).rsplit("-", 2)[0]
        other_file = os.path.basename(publish.temp_path_for(str(tmp_path / "other.safetensors"))).rsplit("-", 2)[0]
        mark = f"{publish.TEMP_MARK}{host}-"
        assert mark in mine
        names = {
            "dead": f"{mine}-{dead}-0123456789ab",
            "live": f"{mine}-{live}-0123456789ab",
            "self": f"{mine}-{os.getpid()}-0123456789ab",
            "other_host": f"{mine.replace(mark, f'{publish.TEMP_MARK}{host}x-')}-{dead}-0123456789ab",
            "other_file": f"{other_file}-{dead}-0123456789ab",
            "not_a_pid": f"{mine}-abc-0123456789ab",
            "user_file": f"{path.name}.bak",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        state = small_state()
        ckptstream.save(state, path)
        left = set(os.listdir(tmp_path))
        assert names["dead"] not in left, "the temp file of a dead writer on this host must go"
        kept = {k for k, name in names.items() if name in left}
        assert kept == set(names) - {"dead"}, "only the dead writer's temp of this path may be removed"
        assert_same_state(ckptstream.load(path), state)
    finally:
        sleeper.kill()
        sleeper.wait()

