"""Fork server for the crash test: imports ckptstream once, builds two versions of a large state,
then for each request forks a fresh writer process that saves one version and exits.

    argv: PATH SIZE_MIB
    stdin:  "save VERSION DIRECT_IO BUFFER_SIZE NUM_BUFFERS HOLD"
            (DIRECT_IO: auto | off; HOLD: none | before_rename | after_rename)
    stdout: "ready"                               once the states are built
            "start PID"                           a writer was forked and is about to save
            "held PID"                            the writer stopped at HOLD, to be killed there
            "done PID {json timings}"             the writer's save returned (if not killed)
            "exit PID STATUS"                     the writer was reaped (STATUS as os.waitpid gives)

The test SIGKILLs writers by pid between "start" and "exit", at random moments or where a writer
holds: the moments just before and just after the rename that publishes are too narrow to hit
by timing on every machine, so a writer asked to can stop there and wait for its kill. Forking
keeps each trial cheap (no interpreter start-up); every writer is still a separate process
killed for real.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

torch.set_num_threads(1)  # no OpenMP worker pool in this process: forking it stays safe

import ckptstream  # noqa: E402
from ckptstream._engine import WriteEngine  # noqa: E402
from tests.reliability.relutil import MiB, training_state  # noqa: E402


def emit(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write per line: writers and the server share stdout


def install_probes(marks: dict[str, float], hold: str) -> None:
    """Record when the data is written and when the rename starts (phase timing), and stop
    before or after that rename where ``hold`` asks to."""
    run, replace = WriteEngine.run, os.replace

    def timed_run(self: Any) -> list[int]:
        result = run(self)
        marks["data_written"] = time.monotonic()
        return result

    def timed_replace(src: str, dst: str, **kwargs: Any) -> None:
        marks["publish"] = time.monotonic()  # the rename that publishes the file
        if hold == "before_rename":
            wait_for_kill()
        replace(src, dst, **kwargs)
        if hold == "after_rename":
            wait_for_kill()

    WriteEngine.run = timed_run  # type: ignore[method-assign]
    os.replace = timed_replace  # type: ignore[assignment]


def wait_for_kill() -> None:
    emit(f"held {os.getpid()}")
    time.sleep(600)  # the test kills it long before; a test that does not fails on its own timeout
    raise SystemExit("the held writer was never killed")


def writer(path: str, state: object, direct_io: str, buffer_size: int, num_buffers: int, hold: str) -> None:
    marks: dict[str, float] = {}
    install_probes(marks, hold)
    emit(f"start {os.getpid()}")
    t0 = time.monotonic()
    ckptstream.save(state, path, settings=ckptstream.Settings(buffer_size=buffer_size, num_buffers=num_buffers,
                                                              direct_io=direct_io))
    t1 = time.monotonic()
    emit(f"done {os.getpid()} " + json.dumps({"total": t1 - t0, **{k: v - t0 for k, v in marks.items()}}))


def main() -> None:
    path, size_mib = sys.argv[1], int(sys.argv[2])
    states = {v: training_state(v, size_mib * MiB) for v in (0, 1)}
    emit("ready")
    for line in sys.stdin:
        cmd, version, direct, buffer_size, num_buffers, hold = line.split()
        assert cmd == "save"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                writer(path, states[int(version)], direct, int(buffer_size), int(num_buffers), hold)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        emit(f"exit {pid} {status}")


if __name__ == "__main__":
    main()
