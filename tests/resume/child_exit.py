"""A process that ends while a background save is in flight (tests/test_async.py).

    child_exit.py CASE PATH
    in-flight           a save still streaming when the script ends: the exit waits for it
    in-flight-slow      the same, slower (the test sends Ctrl-C while the exit waits)
    fails-in-flight     a save that fails after the script ended
    failed-uncollected  a save that failed before the end, its error never asked for
    fork                a fork (as a DataLoader worker is made) while a save is in flight
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine.write import WriteEngine
from tests.resume.trainutil import slow_chunks


def failing_after(chunks: int) -> None:
    real, count = WriteEngine._write, [0]

    def write(self: WriteEngine, chunk: Any, buf: Any) -> None:
        count[0] += 1
        if count[0] > chunks:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self.file.name)
        real(self, chunk, buf)

    WriteEngine._write = write  # type: ignore[method-assign]


def held_until_exit() -> None:
    """This process's saves write nothing until its exit hook has announced that it waits for
    them: a save is still in flight however long anything before takes (a forked child's own
    saves are not held)."""
    from ckptstream._checkpoint import save_async

    parent, gate = os.getpid(), threading.Event()
    real_write, real_say = WriteEngine._write, save_async.say_at_exit

    def write(self: WriteEngine, chunk: Any, buf: Any) -> None:
        if os.getpid() == parent:
            gate.wait()
        real_write(self, chunk, buf)

    def say(line: str) -> None:
        real_say(line)
        if line.startswith("waiting for the background save"):
            gate.set()

    WriteEngine._write = write  # type: ignore[method-assign]
    save_async.say_at_exit = say


def main(case: str, path: str) -> None:
    slow_chunks({"in-flight-slow": 0.25}.get(case, 0.002))  # slow: 16 s, cut short by Ctrl-C
    if case == "fork":
        held_until_exit()
    if case.startswith("fail"):
        failing_after(5)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    handle = ckptstream.save_async(state, path, settings=Settings(buffer_size=64 << 10, num_buffers=2, io_threads=1))
    if case == "failed-uncollected":
        while not handle.done():
            time.sleep(0.01)
    if case == "fork":
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child's own saves do not wait for its parent's
            signal.alarm(20)
            ckptstream.save_async({"x": torch.ones(3)}, path + ".child").result()
            sys.exit(0)  # the ordinary way out: the interpreter's shutdown, with its hooks
        _, status = os.waitpid(pid, 0)
        print(f"forked child exited after {time.monotonic() - start:.2f} s with status {status}")
        assert status == 0, "the forked child failed"
        assert not handle.done(), "the save ended before the forked child: the test proves nothing"
    # the script ends here, with the save in flight


if __name__ == "__main__":
    # a shell that starts a job in the background has it ignore SIGINT; Ctrl-C is what is tested here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1], sys.argv[2])
