"""What a file is when its header is no safetensors header: a torch.save file, a DCP checkpoint's
``.metadata``, another pickle, a gzip or a zip archive, told by its first bytes. The readers ask
only once the header has failed its checks, so a sound checkpoint is never taken for another
kind; what they raise then names the kind and what to do instead of a header length."""

from __future__ import annotations

import dataclasses
import os
import struct

HEAD = 512  # enough of a file's start to tell the kinds below apart

TORCH_SAVE, DCP_METADATA, PICKLE, GZIP, ZIP = "torch.save", "DCP metadata", "pickle", "gzip", "zip"
# torch.save's legacy format opens with a pickled magic number (torch/serialization.py)
_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_DCP_MODULE = b"torch.distributed.checkpoint.metadata"
_ZIP_ENTRY = b"PK\x03\x04"
_ZIP_EMPTY = b"PK\x05\x06"


@dataclasses.dataclass(frozen=True)
class OtherFormat:
    """A format recognised in place of a checkpoint's header: ``kind`` (one of the constants
    above) and the sentence to say of ``path`` (what it is and what to do)."""

    kind: str
    message: str


def recognise(head: bytes, path: str) -> OtherFormat | None:
    """The format that the first bytes ``head`` of the file ``path`` show, or None (a damaged
    checkpoint, or bytes of no kind known here)."""
    if head[8:9] == b"{":  # a header's JSON after its length (which may start as a pickle does: 640 is 80 02 ...)
        return None
    zipped = head.startswith(_ZIP_ENTRY) and _first_zip_name(head).endswith(b"data.pkl")  # torch.save's first entry
    if zipped or head.startswith(_LEGACY_TORCH_SAVE):
        legacy = "" if zipped else " of the legacy (pickle) format"
        return OtherFormat(TORCH_SAVE, (
            f"{path} is a torch.save file{legacy}, not a safetensors checkpoint: read it with torch.load (which "
            "runs code from the file unless weights_only=True: only for files you trust), or convert it once: "
            "ckptstream.save(torch.load(path, weights_only=True), new_path)"))
    if head.startswith(b"\x80") and _DCP_MODULE in head:
        folder = os.path.dirname(path) or "."
        return OtherFormat(DCP_METADATA, (
            f"{path} is a DCP checkpoint's metadata, not a checkpoint file: read the checkpoint through its folder "
            f"{folder} (torch.distributed.checkpoint.load with storage_reader=ckptstream.dcp.StreamReader(folder); "
            f"`ckptstream verify {folder}`)"))
    if head[:1] == b"\x80" and head[1:2] and 2 <= head[1] <= 5:
        return OtherFormat(PICKLE, (
            f"{path} is a Python pickle, not a safetensors checkpoint: ckptstream reads no pickles (unpickling runs "
            "code from the file); load it with the code that wrote it"))
    if head.startswith(b"\x1f\x8b"):
        return OtherFormat(GZIP, (
            f"{path} is a gzip-compressed file, not a safetensors checkpoint: decompress it (gunzip) and read the "
            "file inside"))
    if head.startswith((_ZIP_ENTRY, _ZIP_EMPTY)):
        return OtherFormat(ZIP, (
            f"{path} is a zip archive, not a safetensors checkpoint: extract it and read the checkpoint file inside"))
    return None


def _first_zip_name(head: bytes) -> bytes:
    """The name of a zip archive's first entry (its local header: the name's length at byte 26,
    the name from byte 30), or b"" where ``head`` holds none."""
    if len(head) < 30:
        return b""
    length = struct.unpack_from("<H", head, 26)[0]
    return head[30 : 30 + length]
