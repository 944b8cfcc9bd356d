"""Child of test_interrupts.py: saves and loads, each interrupted by two or three real SIGINTs
0.1-10 ms apart at a random moment, as a user pressing Ctrl-C twice would.

After each interrupt it checks, at the moment the KeyboardInterrupt reaches the caller: no
ckptstream thread is alive, every staging buffer is back in the pool, no descriptor of a file is
left open, no temp file is left, the old checkpoint is still a complete one; and a file opened
right afterwards (which reuses the freed descriptor numbers) receives no stray write.

Usage: child_interrupts.py DIR ROUNDS SEED; prints one JSON line of counts; exits 1 on a failure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypedDict, TypeVar

import torch

import ckptstream
from ckptstream._engine.buffers import POOL
from ckptstream._storage import fileio

SMALL = ckptstream.Settings(buffer_size=64 << 10, num_buffers=3, io_threads=3)
P = ParamSpec("P")
R = TypeVar("R")


class Counts(TypedDict):
    interrupted: int
    completed: int
    failures: list[str]


transferring = threading.Event()  # set by the first chunk of a round's transfer


def slowed(fn: Callable[P, R]) -> Callable[P, R]:
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        transferring.set()
        time.sleep(0.001)  # each chunk takes a millisecond: the interrupts land mid-transfer
        return fn(*args, **kwargs)
    return wrapper


def file_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")):
            out[int(name)] = target
    return out


def signaller(count: int, rng: random.Random, window: float) -> threading.Thread:
    """A thread (not started: its start belongs inside the block that catches the interrupts)
    that sends ``count`` SIGINTs to this process, the first at a random moment of the
    ``window`` seconds after the transfer's first chunk (however busy the machine, the
    transfer has begun: most interrupts land inside it, some in its set-up or end)."""
    def run() -> None:
        transferring.wait(timeout=10)
        time.sleep(rng.uniform(0, window))
        for i in range(count):
            if i:
                time.sleep(rng.uniform(0.0001, 0.010))
            os.kill(os.getpid(), signal.SIGINT)

    return threading.Thread(target=run, name="test-signaller")


late: list[int] = []  # signals of a burst that came after the operation had ended


def count_late(signum: int, frame: Any) -> None:
    late.append(signum)


def settle(thread: threading.Thread) -> None:
    """Wait for the signaller, then until 150 ms pass without a signal: the kernel may run a
    signal's handler a little after kill() returned, in whatever thread it picked."""
    thread.join()
    while True:
        seen = len(late)
        time.sleep(0.15)
        if len(late) == seen:
            return


def snapshot(directory: str) -> dict[str, object]:
    return {
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptstream")),
        "in_use": POOL.in_use,
        "fds": file_fds(),
        "temps": sorted(n for n in os.listdir(directory) if "tmp" in n),
    }


def main() -> int:
    directory, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # a shell that starts a job in the background has it ignore SIGINT; Ctrl-C is what is tested here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(seed)
    fileio.pwrite_all = slowed(fileio.pwrite_all)
    fileio.pread_into = slowed(fileio.pread_into)
    state = {"w": torch.randn(1 << 19), "t": torch.randn(300, 301).t(), "step": 1}
    path = os.path.join(directory, "ckpt.safetensors")
    ckptstream.save(state, path, settings=SMALL)
    baseline = file_fds()
    counts: Counts = {"interrupted": 0, "completed": 0, "failures": []}
    for r in range(rounds):
        op = "save" if r % 2 == 0 else "load"
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's own, while ckptstream runs
        transferring.clear()
        thread = signaller(rng.choice((2, 3)), rng, window=0.006)
        seen = None
        try:
            thread.start()  # a signal may land before start() returns: it is caught below too
            if op == "save":
                ckptstream.save(state, path, settings=SMALL)
            else:
                ckptstream.load(path, mmap=False, settings=SMALL)  # the read engine (a mapped load has no threads)
            signal.signal(signal.SIGINT, count_late)
        except KeyboardInterrupt:
            # before anything else: a later signal of the burst is counted, not raised into the
            # checks. One still pending raises in the call (which runs pending handlers first):
            # inside the try, which the interpreter enters without a check for signals
            while True:
                try:
                    signal.signal(signal.SIGINT, count_late)
                    break
                except KeyboardInterrupt:
                    late.append(signal.SIGINT)
            seen = snapshot(directory)
        settle(thread)
        if seen is None:
            counts["completed"] += 1
            continue
        counts["interrupted"] += 1
        problems = []
        if seen["threads"] or seen["in_use"] or seen["temps"]:
            problems.append(f"{op}: at the interrupt {seen}")
        if seen["fds"] != baseline:
            problems.append(f"{op}: descriptors {seen['fds']} vs {baseline}")
        probe = os.path.join(directory, "probe.bin")
        with open(probe, "wb") as f:  # takes the lowest free descriptor: a freed one
            f.write(b"p" * 4096)
        time.sleep(0.01)
        with open(probe, "rb") as f:
            if f.read() != b"p" * 4096:
                problems.append(f"{op}: a file opened after the interrupt was written to")
        try:
            ckptstream.verify(path)
        except Exception as e:  # any failure is the finding
            problems.append(f"{op}: the checkpoint is no longer complete: {e}")
        counts["failures"] += problems
    print(json.dumps(counts))
    return 1 if counts["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
