"""The optional progress bar of saves and loads (tqdm, on stderr)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, desc: str) -> Iterator[Callable[[int], None] | None]:
    """A callback that advances a bar by a number of bytes, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr) as bar:
        yield bar.update
