"""How long the end of a save lasts in which a Ctrl-C finds the new checkpoint published (its
KeyboardInterrupt's ``published`` is True): from the start of the publish (fsync of the temp,
rename, fsync of the directory) to the return of ``save``, and from the rename on. The figures
of docs/reliability.md ("Ctrl-C during a save").

Usage: python tests/reliability/publish_window.py [DIR]   (DIR: where the files go; default /tmp)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import ckptstream
from ckptstream._storage import files

marks: dict[str, float] = {}
_publish, _replace = files.AtomicSink.publish, os.replace


def timed_publish(self: files.AtomicSink) -> None:
    marks["publish"] = time.perf_counter()
    _publish(self)


def timed_replace(*args: Any, **kwargs: Any) -> None:
    _replace(*args, **kwargs)
    marks["renamed"] = time.perf_counter()


def summary(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds) * 1e3:.1f} ms, max {max(seconds) * 1e3:.1f} ms"


def main() -> None:
    files.AtomicSink.publish = timed_publish  # type: ignore[method-assign]
    os.replace = timed_replace
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as directory:
        path = os.path.join(directory, "ckpt.safetensors")
        for mib in (16, 256):
            state = {"w": torch.randn(mib << 18)}
            whole, after = [], []
            for _ in range(20):
                ckptstream.save(state, path)
                end = time.perf_counter()
                whole.append(end - marks["publish"])
                after.append(end - marks["renamed"])
            print(f"{mib} MiB: publish begun -> save returns: {summary(whole)}; "
                  f"rename -> save returns: {summary(after)}")


if __name__ == "__main__":
    main()
