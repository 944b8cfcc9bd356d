"""Pausing Python's cyclic garbage collector around allocation-heavy phases.

Parsing a header, flattening a state or planning a transfer of many small tensors allocates
hundreds of thousands of objects, none of them in reference cycles; each few hundred
allocations trigger a collection that scans them again (and, now and then, every object of the
process, a training job's millions included). Pausing it there halves those phases.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off inside the block (as it was outside, after; nesting is fine)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
