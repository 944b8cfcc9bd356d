"""What ``ckptstream verify`` and ``inspect`` say of a file that is not a sound checkpoint beyond
the reader's own error: a damaged header located (ckptstream's headers carry their own CRC-32C).
A file of another kind (a torch.save file, a DCP ``.metadata``) the reader names itself
(``NotACheckpointError``)."""

from __future__ import annotations

import json
import struct

import crc32c

from ..storage import Source, storage_for

# of the file format (docs/format.md): the header's own CRC-32C, and safetensors' limit of a header's size
HEADER_CRC_KEY = "ckptstream.header_crc32c"
MAX_HEADER = 100_000_000
_HEADER_CRC_TAG = f'"{HEADER_CRC_KEY}":"'.encode()


def header_damage(path: str) -> str | None:
    """Where the header of ``path`` is damaged, when its own CRC-32C shows that it is (None for
    a header as it was written, or one without that checksum: files of other writers)."""
    try:
        with storage_for(path).open(path) as source:
            prefix = _read(source, 0, 8)
            if len(prefix) < 8:
                return None
            n = struct.unpack("<Q", prefix)[0]
            if n > MAX_HEADER or 8 + n > source.size():
                return None
            raw = prefix + _read(source, 8, n)
    except OSError:
        return None
    at = raw.find(_HEADER_CRC_TAG)
    if at < 0:
        return None
    at += len(_HEADER_CRC_TAG)
    stored = raw[at : at + 8].decode("ascii", "backslashreplace")
    computed = f"{crc32c.crc32c(raw[:at] + b'0' * 8 + raw[at + 8 :]):08x}"
    if stored == computed:
        return None
    return (f"{path}: header corrupt: its bytes 0..{len(raw)} fail their CRC-32C check (stored {stored}, computed "
            f"{computed}); {_first_damage(raw)}; restore the file from another copy")


def _read(source: Source, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes from ``offset`` (fewer where the file ends)."""
    buf = bytearray(length)
    return bytes(buf[: source.read_into(memoryview(buf), offset)])


def _first_damage(raw: bytes) -> str:
    """Where the header's JSON first shows the damage, as far as parsing finds it."""
    body = raw[8:]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte {8 + e.start} is not UTF-8"
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        return f"its JSON breaks at byte {8 + len(text[: e.pos].encode())} ({e.msg})"
    except (ValueError, RecursionError) as e:
        return f"its JSON cannot be read ({type(e).__name__})"
    if not isinstance(table, dict):
        return "it is not a JSON object"
    for key, value in table.items():
        if key == "__metadata__":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                return f'the "__metadata__" entry at byte {_byte_of(raw, key)} is damaged'
        elif not isinstance(value, dict) or not {"dtype", "shape", "data_offsets"} <= set(value):
            hint = ' (a damaged "__metadata__")' if _one_byte_apart(key, "__metadata__") else ""
            return f"the entry {key!r:.60} at byte {_byte_of(raw, key)} is not a tensor entry{hint}"
    if "__metadata__" not in table:
        return 'it has no "__metadata__" entry'
    return "the damage lies inside a value (a dtype, a shape, an offset, the structure or a checksum)"


def _byte_of(raw: bytes, key: str) -> int:
    return raw.find(json.dumps(key, ensure_ascii=False).encode())


def _one_byte_apart(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1
