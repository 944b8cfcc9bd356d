"""ckptstream.dcp: a ``torch.distributed.checkpoint`` (DCP) storage backend.

DCP plans which rank writes which chunk of every DTensor (FSDP2, tensor parallel) and reshards
on load; ``StreamWriter`` and ``StreamReader`` move the bytes: one safetensors file per rank,
streamed straight between device memory and disk through a few pinned buffers, with a CRC-32C
per chunk and an atomic ``.metadata`` written last. The one-line switch::

    import torch.distributed.checkpoint as dcp
    import ckptstream.dcp

    dcp.save(state_dict, storage_writer=ckptstream.dcp.StreamWriter(path))
    dcp.load(state_dict, storage_reader=ckptstream.dcp.StreamReader(path))
    dcp.async_save(state_dict, storage_writer=ckptstream.dcp.StreamWriter(path))  # device snapshot

``dcp_to_torch_save`` converts such a checkpoint into one ``torch.save`` file (torch's own
``format_utils.dcp_to_torch_save`` reads only its ``FileSystemWriter``'s). Reading a checkpoint
runs no code from it: its pickles (``.metadata``, the non-tensor values) are read by an
unpickler that builds only DCP's own classes and plain values (``_pickles``).

Importing it imports ``torch.distributed.checkpoint``; ``import ckptstream`` alone does not.
See docs/dcp.md.
"""

from ._metadata import METADATA_NAME, StoredChunk
from ._rankfile import rank_file_name
from ._reader import StreamReader
from ._tools import as_sharded, checkpoint_files, dcp_to_torch_save
from ._writer import StreamWriter

__all__ = ["METADATA_NAME", "StoredChunk", "StreamReader", "StreamWriter", "as_sharded", "checkpoint_files",
           "dcp_to_torch_save", "rank_file_name"]

