"""The streaming engine: pieces of tensors <-> byte ranges of one file, through a few staging
buffers, on I/O threads of its own. ``plan`` cuts pieces into chunks, ``write`` and ``read``
move them; ``buffers``, ``streams`` and ``tensor_bytes`` are what they move them with."""

from .buffers import release_staging, staging_bytes
from .control import TransferCancelled, interrupts_deferred
from .plan import Piece
from .read import ReadEngine
from .streams import Mark, check_stream, mark
from .tensor_bytes import BYTE_COPIED, PLAIN_TENSORS, check_tensor, copyable, empty_tensor, streamable
from .write import WriteEngine

__all__ = [
    "BYTE_COPIED",
    "PLAIN_TENSORS",
    "Mark",
    "Piece",
    "ReadEngine",
    "TransferCancelled",
    "WriteEngine",
    "check_stream",
    "check_tensor",
    "copyable",
    "empty_tensor",
    "interrupts_deferred",
    "mark",
    "release_staging",
    "staging_bytes",
    "streamable",
]
