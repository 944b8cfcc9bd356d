"""Fork server for tests/test_torchtitan_resume.py on a CPU: imports torchtitan's trainer once
(most of a run's time on a small machine), then forks one child per request that runs
torchtitan's own entry point as child_torchtitan.py does, in a process of its own, killed for real.

    stdin:  "run {json}"   {"fifo": path, "cwd": dir, "env": {...}, "args": [torchtitan.train's]}
            "wait PID"     reap that child
    stdout: "ready", then "started PID" per run and "exit PID STATUS" per wait (os.waitpid's)

Each child writes its standard output into the request's FIFO (the test reads it to choose its
kill point) and its standard error nowhere. The server itself runs no thread and no CUDA: a fork
copies the one thread, and only on a machine without a GPU (the GPU test starts processes).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from typing import Any

import torch

from tests.resume import child_torchtitan  # the launcher's patches


def emit(line: str) -> None:
    os.write(1, (line + "\n").encode())  # unbuffered: no lock of sys.stdout is held across a fork


def child(request: dict[str, Any]) -> None:
    out = os.open(str(request["fifo"]), os.O_WRONLY)  # first: the test waits on it, whatever follows
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(null, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["torchtitan.train", *request["args"]]
    code = 1
    try:
        runpy.run_module("torchtitan.train", run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc(file=sys.stdout)  # where the test sees it
    finally:
        sys.stdout.flush()
        os._exit(code)


def main() -> None:
    assert not torch.cuda.is_available(), "forked runs are for machines without a GPU"
    child_torchtitan.on_cpu()
    child_torchtitan.with_set_timeout()
    child_torchtitan.report()
    import torchtitan.train  # noqa: F401 (imported once, here: what each fork saves)

    emit("ready")
    for line in sys.stdin:
        verb, _, rest = line.strip().partition(" ")
        if verb == "run":
            pid = os.fork()
            if pid == 0:
                child(json.loads(rest))
            emit(f"started {pid}")
        elif verb == "wait":
            pid, status = os.waitpid(int(rest), 0)
            emit(f"exit {pid} {status}")


if __name__ == "__main__":
    main()
