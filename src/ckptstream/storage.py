"""The storage that checkpoints are read and written through, for tools that look at folders and
files the way ckptstream does (the ``ckptstream`` command is one): ``storage_for(path)`` gives
the storage of a local path or URL (``s3://bucket/key``), whose ``list_folder``, ``kind``,
``size``, ``exists``, ``join`` and ``open`` (a ``Source``: ``size()``, ``read_into(buffer,
offset)``) answer for it.

    >>> import ckptstream.storage
    >>> storage = ckptstream.storage.storage_for("ckpt")
    >>> [e.name for e in storage.list_folder("ckpt")]
"""

from ._storage import Entry, Kind, Source, Storage, storage_for

__all__ = ["Entry", "Kind", "Source", "Storage", "storage_for"]
