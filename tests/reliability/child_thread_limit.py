"""Child of test_engine_threads.py: a save or load in a process that can start only ``K`` more
threads, for real: each thread's stack is made large (``threading.stack_size``) and the
address space limited (RLIMIT_AS, which binds root too) to what ``K`` such stacks and a slack
for the transfer's own allocations need, so the next ``pthread_create`` fails.

After the failure, with the limit lifted, it records what the call raised, and what was left:
ckptstream threads alive, staging buffers in use, descriptors of files, files in DIR, what the
checkpoint holds; then runs the same call again (it must now work).

Usage: child_thread_limit.py DIR CASE:K...   (CASE: save, load, load-mapped, save_async,
manager), each in a folder of DIR of its own; prints one JSON line: a report per CASE:K.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

import ckptstream
from ckptstream._engine.buffers import POOL
from tests.helpers import open_fds

STACK = 128 << 20  # each new thread's stack
SLACK = 64 << 20  # what a transfer maps besides thread stacks (staging, a mapped file, tensors)
SMALL = ckptstream.Settings(buffer_size=64 << 10, num_buffers=4, io_threads=3)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def file_fds() -> list[str]:
    """The files (not devices, pipes or sockets) this process holds open."""
    return sorted(t for t in open_fds().values() if t.startswith("/") and not t.startswith(("/dev/", "/proc/")))


def limited(call: Callable[[], Any], threads: int) -> BaseException | None:
    """Run ``call`` where only ``threads`` more threads can start; its exception, if any."""
    threading.stack_size(STACK)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + threads * (STACK + (1 << 20)) + SLACK, resource.RLIM_INFINITY))
    try:
        call()
    except BaseException as e:  # the finding
        return e
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        threading.stack_size(0)
    return None


def run(directory: str, case: str, threads: int) -> dict[str, Any]:
    torch.manual_seed(0)
    old = {"w": torch.randn(4 << 20), "b": torch.randn(1000)}
    new = {k: torch.randn_like(v) for k, v in old.items()}
    path = os.path.join(directory, "ckpt.safetensors")
    ckptstream.save(old, path, settings=SMALL)
    manager = ckptstream.CheckpointManager(os.path.join(directory, "run"), mode="host", settings=SMALL)
    steps = iter((1, 2))
    calls: dict[str, Callable[[], Any]] = {
        "save": lambda: ckptstream.save(new, path, settings=SMALL),
        "load": lambda: ckptstream.load(path, mmap=False, settings=SMALL),
        "load-mapped": lambda: ckptstream.load(path, mmap=True, settings=SMALL),
        "save_async": lambda: ckptstream.save_async(new, path, mode="host", settings=SMALL).result(),
        "manager": lambda: manager.save(new, next(steps), blocking=True),
    }
    fds = file_fds()
    error = limited(calls[case], threads)
    report = {
        "error": type(error).__name__ if error is not None else None,
        "message": str(error),
        "cause": repr(error.__cause__) if error is not None else None,
        "is_runtime_error": isinstance(error, RuntimeError),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptstream")),
        "in_use": POOL.in_use,
        # the manager's lock on its directory is held from its first save on, by design
        "fds_left": sorted(f for f in set(file_fds()) - set(fds) if not os.path.basename(f).startswith(".lock-")),
        "files": sorted(os.path.relpath(os.path.join(d, n), directory)
                        for d, _, names in os.walk(directory) for n in names),
        "old_kept": all(torch.equal(ckptstream.load(path)[k], old[k]) for k in old),
        "steps": manager.steps(),
    }
    got = calls[case]()  # with the limit lifted the same call works
    if case == "manager":
        report["then"] = manager.steps() == [2] and all(torch.equal(manager.load(2)[k], new[k]) for k in new)
    else:
        expected = old if case.startswith("load") else new
        got = got if case.startswith("load") else ckptstream.load(path)
        report["then"] = all(torch.equal(got[k], expected[k]) for k in expected)
    manager.close()
    return report


def main() -> int:
    reports = {}
    for spec in sys.argv[2:]:
        case, threads = spec.split(":")
        directory = os.path.join(sys.argv[1], spec.replace(":", "-"))
        os.mkdir(directory)
        reports[spec] = run(directory, case, int(threads))
    print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
