"""Saves versions FIRST, FIRST+1, ... of a training state over one path, one after another, as
fast as it can, until a line arrives on stdin (the concurrency test loads the path meanwhile
from another process, and says when it has seen enough); then prints the last version saved.

    argv: PATH FIRST SIZE_MIB
"""

from __future__ import annotations

import sys
import threading

from relutil import MiB, training_state

import ckptstream


def main() -> None:
    path, first, size_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stop = threading.Event()

    def wait_for_stop() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    print("ready", flush=True)
    version = first
    while True:
        ckptstream.save(training_state(version, size_mib * MiB), path, buffer_size=1 * MiB, num_buffers=2)
        if stop.is_set():
            break
        version += 1
    print(f"saved {version}", flush=True)


if __name__ == "__main__":
    main()
