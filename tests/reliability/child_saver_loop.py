"""Saves versions FIRST..LAST of a training state over one path, one after another, as fast as
it can (the concurrency test loads the path meanwhile from another process).

    argv: PATH FIRST LAST SIZE_MIB
"""

from __future__ import annotations

import sys

from relutil import MiB, training_state

import ckptstream


def main() -> None:
    path, first, last, size_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print("ready", flush=True)
    for version in range(first, last + 1):
        ckptstream.save(training_state(version, size_mib * MiB), path, buffer_size=1 * MiB, num_buffers=2)


if __name__ == "__main__":
    main()
