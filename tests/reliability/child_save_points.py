"""Child of test_interrupts.py: one real SIGINT at each of many points of a save, found by
counting the Python events (calls, lines, returns) of the main thread, every one from the start
of the publish on; what the save raised compared with what is on disk.

A dry run counts the events of a save and where its publish begins. Then, for each point, the
old checkpoint is saved again and a save of a new state runs under a trace function that sends
SIGINT to this process (Python's default handler) at that event. Printed, one JSON line: the
event counts and per point the outcome ("returned", or the KeyboardInterrupt's ``published``
attribute, "missing" where it has none), what ``path`` holds ("new", "old", "neither") and what
was left behind (temp files, ckptstream threads, staging buffers in use).

Usage: child_save_points.py DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import torch

import ckptstream
from ckptstream._engine.buffers import POOL
from ckptstream._storage import files

SMALL = ckptstream.Settings(buffer_size=64 << 10, num_buffers=3, io_threads=2)
SPREAD = 40  # points before the publish, evenly spaced
SAVE = ckptstream.save.__code__


class Events:
    """A trace function for the main thread: counts events and sends SIGINT at event ``at``;
    notes the event where AtomicSink.publish is called. The events of ``save``'s own frame are
    not counted: there the interpreter checks for signals only as the call begins (before
    anything of the save has run: a signal then is one before the save) and as each call it
    makes returns, which the callee's return event stands for."""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.count, self.publish = at, 0, None if at is None else -1

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is SAVE:
            return self
        if self.publish is None and event == "call" and frame.f_code is files.AtomicSink.publish.__code__:
            self.publish = self.count
        self.count += 1
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return None if self.at is not None and self.count > self.at else self


def on_disk(path: str, new: dict[str, Any], old: dict[str, Any]) -> str:
    try:
        got = ckptstream.load(path, mmap=False)
    except Exception as e:  # any failure is the finding
        return f"unreadable: {e}"
    for name, state in (("new", new), ("old", old)):
        if got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state):
            return name
    return "neither"


def traced_save(state: dict[str, Any], path: str, events: Events) -> str:
    sys.settrace(events)
    try:
        ckptstream.save(state, path, settings=SMALL)
    except KeyboardInterrupt as e:
        sys.settrace(None)
        return str(getattr(e, "published", "missing"))
    finally:
        sys.settrace(None)
    return "returned"


def main() -> int:
    directory = sys.argv[1]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job ignores SIGINT
    torch.manual_seed(0)
    old = {"w": torch.randn(1 << 17), "t": torch.randn(200, 201).t(), "b": torch.randn(7)}
    new = {k: torch.randn_like(v) for k, v in old.items()}
    path = os.path.join(directory, "ckpt.safetensors")
    dry = Events()
    ckptstream.save(old, path, settings=SMALL)
    assert traced_save(new, path, dry) == "returned"
    assert dry.publish is not None, "the save did not publish through files.AtomicSink"
    step = max(1, dry.publish // SPREAD)
    points = [*range(1, dry.publish, step), *range(dry.publish, dry.count + 1)]
    results = []
    for at in points:
        ckptstream.save(old, path, settings=SMALL)
        outcome = traced_save(new, path, Events(at))
        results.append({
            "at": at, "outcome": outcome, "disk": on_disk(path, new, old),
            "temps": sorted(n for n in os.listdir(directory) if n != "ckpt.safetensors"),
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptstream")),
            "in_use": POOL.in_use,
        })
    print(json.dumps({"events": dry.count, "publish": dry.publish, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
