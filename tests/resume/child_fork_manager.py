"""A process that forks while its CheckpointManager saves (tests/test_manager_processes.py).

    child_fork_manager.py DIR VARIANT

Saves step 1, then starts step 2, whose write is held until the forked child is done with the
inherited manager, and forks. The child, by VARIANT:
    wait    calls wait(), cannot save, then leaves with sys.exit inside the manager's ``with`` block
    close   calls close() twice, then the same
    exit    leaves with sys.exit inside the manager's ``with`` block at once
    linger  stays alive (as a DataLoader worker does) until the parent has closed its manager
            and saved with a new one
None of it may wait for the parent's save, nor release the parent's lock, nor save (with the
parent's manager). Prints a JSON report.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
from typing import Any

import torch

import ckptstream
from ckptstream._checkpoint import save, save_async


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "step": step}


def lock_is_free(directory: str) -> bool:
    fd = os.open(os.path.join(directory, ".lock-rank-00000"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases it again, if taken
    return True


def read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return data


def main(directory: str, variant: str) -> None:
    started, gate = threading.Event(), threading.Event()
    real = save.write_checkpoint

    def held(plan: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if "step-000000000002" in path:
            started.set()
            gate.wait()
        real(plan, path, *args, **kwargs)

    save_async.write_checkpoint = held  # type: ignore[attr-defined,assignment]
    report: dict[str, Any] = {}
    done_r, done_w = os.pipe()  # the child closes its end when it ends
    go_r, go_w = os.pipe()  # the parent closes its end when a lingering child may go
    with ckptstream.CheckpointManager(directory, keep=3) as ckpts:
        ckpts.save(state(1), 1, blocking=True)
        handle = ckpts.save(state(2), 2)
        started.wait()
        pid = os.fork()
        if pid == 0:
            os.close(done_r)
            os.close(go_w)
            if variant == "wait":
                ckpts.wait()
                try:
                    ckpts.save(state(3), 3)
                    os._exit(3)  # it saved with its parent's manager
                except RuntimeError as e:
                    if f"belongs to process {os.getppid()}" not in str(e):
                        os._exit(4)
            elif variant == "close":
                ckpts.close()
                ckpts.close()
            elif variant == "linger":
                read_all(go_r)
            sys.exit(0)  # through the with block's exit, then the interpreter's own shutdown
        os.close(done_w)
        os.close(go_r)
        if variant != "linger":
            read_all(done_r)  # until the child has ended
            report["status"] = os.waitpid(pid, 0)[1]
            report["lock_held_after_child"] = not lock_is_free(directory)
        report["save_waited_for_child"] = not handle.done()
        gate.set()
        report["saved"] = handle.result() == os.path.join(directory, "step-000000000002", "state.safetensors")
    report["lock_free_after_close"] = lock_is_free(directory)
    if variant == "linger":  # the child still holds what it inherited
        with ckptstream.CheckpointManager(directory, keep=3) as again:
            again.save(state(3), 3, blocking=True)
        os.close(go_w)
        read_all(done_r)
        report["status"] = os.waitpid(pid, 0)[1]
    with ckptstream.CheckpointManager(directory) as reader:
        report["steps"] = reader.steps()
        report["loaded"] = torch.equal(reader.load(2)["w"], state(2)["w"])
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
