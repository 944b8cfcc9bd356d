"""A rank of a gloo run whose CheckpointManager, kept in no variable, refuses to save a DTensor,
then ends without ``destroy_process_group`` (tests/test_manager_processes.py; rank 1 leaves its group after its save).

    child_refused_exit.py RANK WORLD_SIZE DIR

Rank 0 tries ``CheckpointManager(DIR / "ckpts").save({"w": dtensor}, 1)`` and prints "refused".
Rank 1 (of 2) makes its manager (a collective call), prints "made", and saves only once a line
comes on stdin. Every rank's last atexit hook prints on stderr how many of the manager's threads
are still running then: the interpreter shuts down after it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ckptstream

try:
    from torch.distributed.tensor import Replicate, distribute_tensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import Replicate, distribute_tensor  # type: ignore[attr-defined]


def running_at_exit() -> None:
    running = [t.name for t in threading.enumerate() if t.name.startswith("ckptstream-manager-")]
    sys.stderr.write(f"at exit: {len(running)} manager thread(s) running\n")
    sys.stderr.flush()


def main(rank: int, world_size: int, folder: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where the test runs with SIGINT ignored
    atexit.register(running_at_exit)  # the first registered runs last
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'init')}", rank=rank,
                            world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    w = distribute_tensor(torch.randn(64, 8, generator=torch.Generator().manual_seed(7)), mesh, [Replicate()])
    directory = os.path.join(folder, "ckpts")
    try:
        if rank == 0:
            ckptstream.CheckpointManager(directory).save({"w": w}, 1)
        else:
            ckpts = ckptstream.CheckpointManager(directory)
            print("made", flush=True)
            sys.stdin.readline()
            ckpts.save({"w": w}, 1)
            ckpts.wait()
            # rank 0 is the process under test; rank 1 leaves its group so that gloo's threads
            # do not race the interpreter's shutdown once rank 0 has gone (an abort under load)
            dist.destroy_process_group()
    except ckptstream.UnsupportedTypeError:
        print("refused", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
