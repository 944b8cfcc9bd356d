"""Moved to the storage wing (``_storage.fileio``): this name stays only for the modules not yet
ported onto the storage seam (the manager's directory, DCP's metadata and rank files), and goes
with them."""

from ._storage.fileio import _KINDS, fsync, open_path, pwrite_all

__all__ = ["_KINDS", "fsync", "open_path", "pwrite_all"]
