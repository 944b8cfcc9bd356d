"""Moved to the storage wing (``_storage.publish``, ``_storage.files.AtomicSink``): these names
stay only for the modules not yet ported onto the storage seam (the manager's directory and
ranks, background saves, DCP's metadata and rank files), and go with them."""

from ._storage.fileio import fsync_dir
from ._storage.files import AtomicSink
from ._storage.publish import TEMP_MARK, check_target, remove_stale_temps


def atomic_file(path: str) -> AtomicSink:
    """A new file published over ``path`` when the ``with`` block ends normally (see
    ``AtomicSink``); its ``fd`` and ``path`` (the temp's) take the writes."""
    return AtomicSink(path)


__all__ = ["TEMP_MARK", "atomic_file", "check_target", "fsync_dir", "remove_stale_temps"]
