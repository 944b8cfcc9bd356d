"""What runs as the interpreter exits: a hook that waits for work still in flight (threading's
own exit hook, before the atexit hooks and before the daemon threads are ended), the lines it
says, and how a Ctrl-C there ends the process."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable


def register(hook: Callable[[], None]) -> bool:
    """Run ``hook`` at exit: in threading's exit hook where it can still be registered (returns
    True), else among the atexit hooks (the interpreter is shutting down already, or has no
    such hook)."""
    add = getattr(threading, "_register_atexit", None)
    try:
        if add is None:
            raise RuntimeError
        add(hook)
        return True
    except RuntimeError:
        atexit.register(hook)
        return False


def say(line: str) -> None:
    """A line on stderr straight away: at interpreter exit, logging may be shut down already."""
    try:
        sys.stderr.write(f"ckptstream: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: nothing else can be told
        pass


def end_interrupted(before_atexit: bool) -> None:
    """End the process as Python ends one that a Ctrl-C interrupted: the atexit hooks run (where
    ``before_atexit``: inside them, they are running), then the process kills itself with
    SIGINT (exit status 130 in a shell, which then stops a script that ran it), never with
    status 0 as if all had gone well, and never through the shutdown that a daemon thread still
    inside native code would abort."""
    run_hooks = getattr(atexit, "_run_exitfuncs", None)
    if before_atexit and run_hooks is not None:
        run_hooks()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or replaced
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # only where the signal could not end the process
