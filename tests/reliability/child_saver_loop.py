"""Saves versions FIRST..LAST of a training state over one path, one after another, in step with
the concurrency test, which loads the path from its own process around each save.

    argv: PATH FIRST LAST SIZE_MIB
    stdin:  "go"       save the next version
            "publish"  rename the written temp over the path (the save's publish)
    stdout: "ready"                   the states can be made
            "written VERSION"         the temp file is complete and fsynced, not yet renamed
            "saved VERSION"           the save returned: the path holds VERSION
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ckptstream
from ckptstream import Settings
from tests.reliability.relutil import MiB, training_state


def tell(line: str) -> None:
    print(line, flush=True)


def expect(word: str) -> None:
    line = sys.stdin.readline().strip()
    assert line == word, f"expected {word!r} from the test, got {line!r}"


def main() -> None:
    path, first, last, size_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    real_replace = os.replace
    version = [first]

    def publish_when_told(src: Any, dst: Any, **kwargs: Any) -> None:
        tell(f"written {version[0]}")
        expect("publish")
        real_replace(src, dst, **kwargs)

    os.replace = publish_when_told
    tell("ready")
    for v in range(first, last + 1):
        version[0] = v
        expect("go")
        ckptstream.save(training_state(v, size_mib * MiB), path, settings=Settings(buffer_size=1 * MiB, num_buffers=2))
        tell(f"saved {v}")


if __name__ == "__main__":
    main()
