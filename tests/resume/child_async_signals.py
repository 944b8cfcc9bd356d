"""Ctrl-C and fork around saves, in a real process (tests/test_async.py sends the signals).

    child_async_signals.py CASE PATH
    exit-wait   a background save that never ends by itself is in flight when the script ends:
                the exit waits for it (and says so on stderr) until the test's Ctrl-C
    result      result() waits for a background save held back until the test's Ctrl-C has
                interrupted it; prints one JSON line of what the handle says then, and after
    sync-save   a synchronous save whose first chunk waits until the transfer is stopped: the
                test's Ctrl-C ends the script with Python's own report of the KeyboardInterrupt
    fork        a fork (as a DataLoader worker is made) while a background save is held back; the
                save goes on only once the forked child has exited

The cases print "waiting in ..." on stdout once the main thread is where the test's signal must
land (found by looking at the main thread's stack, not after a delay).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
from typing import Any

import torch

import ckptstream
from ckptstream._checkpoint import save, save_async
from ckptstream._engine.write import WriteEngine


def announce(line: str) -> None:
    print(line, flush=True)


def hold_saves_of(path: str, release: threading.Event) -> None:
    """Background saves of ``path`` start writing only once ``release`` is set."""
    real = save.write_checkpoint

    def held(plan: Any, target: str, *args: Any, **kwargs: Any) -> None:
        if target == path:
            release.wait()
        real(plan, target, *args, **kwargs)

    save_async.write_checkpoint = held  # type: ignore[attr-defined,assignment]


def when_main_thread_waits_in(function: str, line: str) -> None:
    """Print ``line`` once the main thread's stack holds a call of ``function`` (of _async)."""
    main = threading.main_thread().ident
    assert main is not None

    def inside() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == function and frame.f_code.co_filename == save_async.__file__:
                return True
            frame = frame.f_back
        return False

    def watch() -> None:
        looked = threading.Event()
        while not inside():
            looked.wait(0.005)
        announce(line)

    threading.Thread(target=watch, name="test-watcher", daemon=True).start()


def state() -> dict[str, Any]:
    torch.manual_seed(3)
    return {"w": torch.randn(1 << 16), "step": 5}


def exit_wait(path: str) -> None:
    hold_saves_of(path, threading.Event())  # never released: only a Ctrl-C ends the wait
    atexit.register(lambda: announce("the program's own atexit hook ran"))
    ckptstream.save_async(state(), path)
    # the script ends here; the exit hook waits for the save


def result(path: str) -> None:
    release = threading.Event()
    hold_saves_of(path, release)
    handle = ckptstream.save_async(state(), path)
    when_main_thread_waits_in("result", "waiting in result()")
    try:
        handle.result()
        announce(json.dumps({"interrupted": False}))
        return
    except KeyboardInterrupt:
        at_interrupt = {"done": handle.done(), "published": os.path.exists(path)}
    release.set()
    announce(json.dumps({"interrupted": True, "at_interrupt": at_interrupt, "then": handle.result()}))


def sync_save(path: str) -> None:
    ckptstream.save({"old": torch.arange(4)}, path)
    real = WriteEngine._write
    first = [True]

    def write(self: WriteEngine, chunk: Any, buf: Any) -> None:
        if first[0]:
            first[0] = False
            stopped = threading.Event()
            announce("waiting in the save's first chunk")
            while not self.failure.stopped:  # the Ctrl-C's stop, seen at once
                stopped.wait(0.005)
        real(self, chunk, buf)

    WriteEngine._write = write  # type: ignore[method-assign]
    ckptstream.save(state(), path, settings=ckptstream.Settings(buffer_size=64 << 10, num_buffers=2, io_threads=1))
    announce("the save was not interrupted")


def fork(path: str) -> None:
    release = threading.Event()
    hold_saves_of(path, release)
    handle = ckptstream.save_async(state(), path)
    pid = os.fork()
    if pid == 0:  # the child's own saves do not wait for its parent's
        signal.alarm(60)  # a child that waits for its parent's save would never end: fail instead
        with open(path + ".child-stderr", "w") as err:
            os.dup2(err.fileno(), 2)
        ckptstream.save_async({"x": torch.ones(3)}, path + ".child").result()
        sys.exit(0)  # the ordinary way out: the interpreter's shutdown, with its hooks
    _, status = os.waitpid(pid, 0)
    done_then = handle.done()
    release.set()
    handle.result()
    announce(json.dumps({"status": status, "parent_save_done_when_child_exited": done_then}))


if __name__ == "__main__":
    # a shell that starts a job in the background has it ignore SIGINT; Ctrl-C is what is tested here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    case, target = sys.argv[1], sys.argv[2]
    {"exit-wait": exit_wait, "result": result, "sync-save": sync_save, "fork": fork}[case](target)
