"""A process that ends while a background save is in flight (tests/test_async.py).

    child_exit.py CASE PATH
    in-flight           a save still streaming when the script ends: the exit waits for it
    in-flight-slow      the same, slower (the test sends Ctrl-C while the exit waits)
    fails-in-flight     a save that fails after the script ended
    failed-uncollected  a save that failed before the end, its error never asked for
"""

from __future__ import annotations

import errno
import signal
import sys
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


def main(case: str, path: str) -> None:
    slow_chunks({"in-flight-slow": 0.25}.get(case, 0.002))  # slow: 16 s, cut short by Ctrl-C
    if case.startswith("fail"):
        failing_after(5)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    handle = ckptstream.save_async(state, path, settings=Settings(buffer_size=64 << 10, num_buffers=2, io_threads=1))
    if case == "failed-uncollected":
        while not handle.done():
            time.sleep(0.01)
    # the script ends here, with the save in flight


if __name__ == "__main__":
    # a shell that starts a job in the background has it ignore SIGINT; Ctrl-C is what is tested here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1], sys.argv[2])
