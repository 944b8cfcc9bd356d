"""The storage that checkpoints are read and written through, for tools that look at folders and
files the way ckptstream does (the ``ckptstream`` command is one): ``storage_for(path)`` gives
the storage of a local path or URL (``s3://bucket/key``), whose ``list_folder``, ``kind``,
``size``, ``exists``, ``join`` and ``open`` (a ``Source``: ``size()``, ``read_into(buffer,
offset)``) answer for it.

It is also the seam a third party implements to add a target: subclass ``Storage``, ``Sink``
and ``Source`` (with ``Lock``, ``Region``, ``Entry``, ``Kind``, ``Target`` and ``round_up`` /
``round_down`` for the grid), then ``register("foo", FooStorage)`` in the process, or declare
the storage in the ``ckptstream.storages`` entry-point group of a distribution (``foo =
ckptstream_foo:FooStorage``) so that installing it adds ``foo://`` URLs. docs/architecture.md,
"A new storage", has a worked example.

    >>> import ckptstream.storage
    >>> storage = ckptstream.storage.storage_for("ckpt")
    >>> [e.name for e in storage.list_folder("ckpt")]
"""

from ._storage import Entry, Kind, Lock, LockHeldError, Region, Sink, Source, Storage, Target, register, storage_for
from ._storage.base import round_down, round_up
from ._storage.dispatch import ENTRY_POINTS

__all__ = ["ENTRY_POINTS", "Entry", "Kind", "Lock", "LockHeldError", "Region", "Sink", "Source", "Storage",
           "Target", "register", "round_down", "round_up", "storage_for"]
