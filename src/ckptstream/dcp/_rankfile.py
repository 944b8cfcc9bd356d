"""One rank's file of a DCP checkpoint: a safetensors file planned from the rank's write items.

Every chunk the rank writes is one tensor of the file, named by its DCP fully-qualified name
(a name that would repeat, or clash with ``__metadata__``, gets its chunk's offsets appended);
non-tensor values (DCP's BYTE_IO items, torch.save bytes) are U8 tensors. The header is encoded
before any data is written: the table in safetensors' order (every tensor aligned to its
element size, the data section to 4096 bytes), and in ``__metadata__`` what torch's
``HuggingFaceStorageReader`` needs to place each chunk in its global tensor
(``DCP_SHARDING_INFO``: every key's offsets), plus the CRC-32C placeholders that the write
fills in. The data is then streamed straight from the tensors' memory through the write
engine into a temp file beside the final name, which is published atomically.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Sequence

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .._checkpoint.save import CheckpointPlan, write_checkpoint
from .._engine import Mark, check_tensor
from .._errors import UnsupportedTypeError
from .._format import header as _header
from .._format.header import TensorInfo
from .._settings import Settings
from .._storage import storage_for
from ._metadata import StoredChunk

RANK_FILE = "rank-{rank:05d}.safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch's hf_storage keys
HF_METADATA = {"DCP_VERSION": "1.0", "format": "pt"}


def rank_file_name(rank: int) -> str:
    return RANK_FILE.format(rank=rank)


def is_rank_file(name: str) -> bool:
    head, tail = RANK_FILE.split("{", 1)[0], RANK_FILE.rsplit("}", 1)[1]
    middle = name[len(head) : len(name) - len(tail)]
    return name.startswith(head) and name.endswith(tail) and middle.isdigit()


def remove_leftovers(directory: str, keep: set[str]) -> None:
    """Remove the rank files of an earlier save that this one does not replace (it had more
    ranks), and the leftovers (temps, uploads) of rank files whose writers are gone."""
    storage = storage_for(directory)
    names = [e.name for e in storage.list_folder(directory)] + storage.unfinished(directory)
    for name in sorted({n for n in names if is_rank_file(n)} | keep):
        path = storage.join(directory, name)
        if name not in keep:
            storage.remove(path, missing_ok=True)
        storage.remove_temps(path)


def check_items(items: Sequence[WriteItem]) -> None:
    """Raise before any file is written for a tensor whose dtype safetensors has no name for."""
    for item in items:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            dtype = item.tensor_data.properties.dtype
            if dtype not in _header.DTYPE_NAMES:
                raise UnsupportedTypeError(
                    f"{item.index.fqn}: dtype {dtype} has no safetensors name, so ckptstream.dcp.StreamWriter cannot "
                    f"store it{_header.unnamed_hint(dtype)}; supported: {sorted(str(d) for d in _header.DTYPE_NAMES)}")


def chunk_keys(items: Sequence[WriteItem]) -> list[str]:
    """The file's tensor name of each item: its fqn where that is unique in the file."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.index.fqn] = counts.get(item.index.fqn, 0) + 1
    taken = {fqn for fqn, n in counts.items() if n == 1 and fqn != "__metadata__"}
    keys = []
    for item in items:
        fqn = item.index.fqn
        if fqn in taken and counts[fqn] == 1:
            keys.append(fqn)
            continue
        base = f"{fqn}@{','.join(map(str, _offsets(item)))}"
        key, n = base, 1
        while key in taken:
            key, n = f"{base}#{n}", n + 1
        taken.add(key)
        keys.append(key)
    return keys


def _offsets(item: WriteItem) -> list[int]:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return [0]
    return [int(o) for o in item.tensor_data.chunk.offsets]


@dataclasses.dataclass
class RankFile:
    """What one rank writes: the header (with placeholder checksums) and, in file order, the
    item each stored tensor comes from."""

    name: str
    header: bytes
    infos: list[TensorInfo]  # file order
    item_of: list[int]  # per info: the index of its write item
    checksum: bool

    @classmethod
    def plan(cls, name: str, items: Sequence[WriteItem], blob_sizes: dict[int, int], checksum: bool) -> RankFile:
        """The file for ``items``; a BYTE_IO item ``i`` holds ``blob_sizes[i]`` bytes."""
        keys = chunk_keys(items)
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for i, (item, key) in enumerate(zip(items, keys, strict=True)):
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                entries.append((key, torch.uint8, (blob_sizes[i],)))
            else:
                entries.append((key, item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes)))
        infos = _header.data_offsets(entries)
        sharding = {key: {"saved_offsets": _offsets(item)} for item, key in zip(items, keys, strict=True)}
        metadata = {SHARDING_INFO_KEY: json.dumps(sharding, separators=(",", ":")), **HF_METADATA}
        header = _header.encode(infos, metadata, None, checksums=checksum)
        index = {key: i for i, key in enumerate(keys)}
        return cls(name, header, infos, [index[info.name] for info in infos], checksum)

    def write(self, directory: str, tensors: list[torch.Tensor], cfg: Settings, *, after: Mark | None,
              copied: Callable[[], None] | None = None) -> list[StoredChunk]:
        """Stream ``tensors`` (per info, in file order) into the file, publish it atomically,
        and return each info's storage record; ``copied`` is called once the tensors' bytes are
        all out of their memory (before the file is made durable)."""
        plan = CheckpointPlan(self.header, self.infos, tensors, self.checksum)
        crcs = write_checkpoint(plan, storage_for(directory).join(directory, self.name), cfg, after=after,
                                staged=copied)
        start = len(self.header)
        return [StoredChunk(self.name, start + info.begin, info.nbytes, info.name, crcs[i] if self.checksum else None)
                for i, info in enumerate(self.infos)]


def blob_tensor(data: object, fqn: str) -> torch.Tensor:
    """The bytes of a resolved BYTE_IO item as a U8 tensor."""
    if isinstance(data, io.BytesIO):
        raw = bytearray(data.getbuffer())
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytearray(data)
    else:
        raise TypeError(f"{fqn}: the planner resolved a BYTE_IO item to a {type(data).__name__}, expected io.BytesIO")
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def chunk_tensor(data: object, item: WriteItem) -> torch.Tensor:
    """A resolved tensor item, checked against its planned chunk (dtype and shape)."""
    fqn = item.index.fqn
    t = check_tensor(data, f"{fqn!r} (as the planner resolved it)").detach()
    assert item.tensor_data is not None
    want = (item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
    if (t.dtype, tuple(t.shape)) != want:
        raise ValueError(f"{fqn}: the planner planned a chunk of {want[0]} {list(want[1])} but resolved a tensor of "
                         f"{t.dtype} {list(t.shape)}; the file's header is planned from the plan, so they must agree")
    return t
