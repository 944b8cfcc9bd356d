"""Threads that tell the other ranks of a save refused before it began (``CheckpointManager.save``
raises at once; the others wait in a collective for this rank's outcome), waited for before the
interpreter shuts down.

Such a thread spends its time inside gloo collectives, with the GIL released. Were it still there
when the interpreter finalizes, it would try to take the GIL back when the collective returns and
be ended by the interpreter from inside torch's C++ frames, which aborts the process. So exit
waits for it (threading's exit hook, before the atexit hooks and the shutdown), saying so on
stderr: the collective ends within the manager's timeout. A Ctrl-C there abandons it and ends
the process as an interrupted one, without the shutdown that would abort.
"""

from __future__ import annotations

import os
import threading

from .._checkpoint import exiting
from .._engine import control

_lock = threading.Lock()
_running: list[tuple[threading.Thread, str | None]] = []  # with what it tells, for the line said at exit
_hooked = False
_in_threading_hook = False  # the hook runs before the atexit hooks (not among them)


def start(thread: threading.Thread, what: str | None, role: str) -> None:
    """Start ``thread`` (a daemon), which tells the other ranks ``what``; exit waits for it (and
    says so, unless ``what`` is None: no other rank waits). ``role`` names the thread in the
    ThreadStartError raised where it cannot start."""
    global _hooked, _in_threading_hook
    with _lock:
        _running[:] = [(t, w) for t, w in _running if t.is_alive()]
        _running.append((thread, what))
        if not _hooked:
            _hooked = True
            _in_threading_hook = exiting.register(_at_exit)
    control.start(thread, role)


def _at_exit() -> None:
    with _lock:
        running = [(t, w) for t, w in _running if t.is_alive()]
    try:
        for thread, what in running:
            if what is not None and thread.is_alive():
                exiting.say(f"waiting to tell the other ranks {what} before exiting (at most the manager's "
                            "timeout; Ctrl-C abandons it)")
            while thread.is_alive():  # in slices: a Ctrl-C is seen between them
                thread.join(0.1)
    except KeyboardInterrupt:
        exiting.say("abandoned telling the other ranks: they wait until the manager's timeout")
        exiting.end_interrupted(_in_threading_hook)


def _forget_after_fork() -> None:
    global _lock, _running
    _lock, _running = threading.Lock(), []  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_after_fork)
