"""Where the bytes of a chunk that DCP's ``FileSystemWriter`` saved lie, found without running
code from the checkpoint.

Each chunk is a ``torch.save`` archive (a zip file, entries stored uncompressed) at a byte range
of a ``.distcp`` file: ``data.pkl`` pickles the tensor (a ``_rebuild_tensor_v2`` or ``_v3`` call
on a storage that a persistent id names, an offset, a size, a stride) and ``data/<key>`` holds
that storage's raw bytes. The zip's directory is read through the source, ``data.pkl`` by
``_pickles.SafeUnpickler`` building only a description of that call (no tensor, no storage),
and the storage's entry is found from its local header: the export then streams the bytes
like any other chunk's. Anything else (compressed entries, DCP's stream extensions, a pickle of
another object, strides that are not row-major, big-endian data) is refused with the reason.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from typing import Any, NamedTuple

import torch

from .._errors import ExportError
from .._storage import Source
from ..dcp import _pickles
from ..dcp._pickles import Allowed, Refused

MAX_PICKLE = 1 << 20  # a tensor's data.pkl is a few hundred bytes
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length
# the storage classes of torch.save's typed storages, by name, with their dtypes (quantized ones left out)
_LEGACY = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
           if not name.startswith("Q") and isinstance(getattr(torch, name, None), type)}
_LEGACY_STORAGES: dict[str, type] = {name: getattr(torch, name) for name in _LEGACY}


class _Storage(NamedTuple):
    key: str
    dtype: torch.dtype | None  # None: an untyped storage (numel counts bytes)
    numel: int


class Stored(NamedTuple):
    """What a chunk's data.pkl says: a tensor over a storage."""

    storage: _Storage
    offset: int  # elements of ``dtype`` into the storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or not all(type(v) is int and v >= 0 for v in value):
        raise Refused(f"gives {what} {value!r:.80}, not a tuple of non-negative ints")
    return tuple(value)


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
             dtype: Any = None, metadata: Any = None) -> Stored:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise Refused("rebuilds a tensor from something other than a storage and an offset")
    if not isinstance(requires_grad, bool) or (hooks is not None and (not isinstance(hooks, dict) or hooks)):
        raise Refused("rebuilds a tensor with backward hooks")
    if metadata is not None and (not isinstance(metadata, dict) or metadata):
        raise Refused("rebuilds a tensor with Python attributes")
    dtype = dtype if dtype is not None else storage.dtype
    if not isinstance(dtype, torch.dtype) or (storage.dtype is not None and dtype != storage.dtype):
        raise Refused(f"rebuilds a tensor of dtype {dtype!r:.40} from a storage of {storage.dtype}")
    return Stored(storage, offset, _ints(size, "a size"), _ints(stride, "a stride"), dtype)


def _v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
        metadata: Any = None) -> Stored:
    return _rebuild(storage, offset, size, stride, requires_grad, hooks, None, metadata)


TENSOR = _pickles.PLAIN | Allowed(
    classes={},
    calls={("torch._utils", "_rebuild_tensor_v2"): _v2, ("torch._utils", "_rebuild_tensor_v3"): _rebuild},
    values={**{("torch", name): cls for name, cls in _LEGACY_STORAGES.items()},
            ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
            ("torch", "UntypedStorage"): torch.UntypedStorage},
)  # fmt: skip
_STORAGE_DTYPES: dict[int, torch.dtype | None] = {id(torch.UntypedStorage): None,
                                                   **{id(getattr(torch, n)): d for n, d in _LEGACY.items()}}


class _TensorUnpickler(_pickles.SafeUnpickler):
    """Builds a ``Stored`` description; a storage's persistent id becomes a ``_Storage``."""

    def persistent_load(self, pid: Any) -> _Storage:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise Refused(f"refers to a persistent object {pid!r:.80}, not a storage")
        _, kind, key, _location, numel = pid
        if id(kind) not in _STORAGE_DTYPES or type(key) is not str or type(numel) is not int or numel < 0:
            raise Refused(f"refers to a storage {pid!r:.80} of no kind torch.save writes")
        return _Storage(key, _STORAGE_DTYPES[id(kind)], numel)


class _Window(io.RawIOBase):
    """Bytes ``offset``..``offset + length`` of a source as a seekable file (what zipfile reads)."""

    def __init__(self, source: Source, offset: int, length: int) -> None:
        super().__init__()
        self._source, self._offset, self._length, self._pos = source, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        got = self._source.read_into(view[:n], self._offset + self._pos) if n else 0
        self._pos += got
        return got


def locate(source: Source, offset: int, length: int, what: str) -> tuple[int, torch.dtype, tuple[int, ...]]:
    """The file offset of the row-major bytes of the tensor that ``torch.save`` wrote at bytes
    ``offset``..``offset + length`` of ``source``, with its dtype and shape."""
    window = _Window(source, offset, length)
    try:
        archive = zipfile.ZipFile(window)
        pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError("it holds no single data.pkl")
        root = pickles[0].filename[: -len("data.pkl")]
        if pickles[0].file_size > MAX_PICKLE or pickles[0].compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"its data.pkl is {pickles[0].file_size} bytes or compressed; a tensor's is small")
        order = _byteorder(archive, root)
        try:
            stored = _TensorUnpickler(archive.read(pickles[0]), TENSOR).load()
        except Refused as e:
            raise ExportError(f"{what}: its data.pkl {e}, which a tensor that torch.save wrote never does, so it "
                              "cannot be read without running code from the checkpoint. Load the checkpoint with "
                              "DCP in a process that trusts it, save it with ckptstream.save (or "
                              "ckptstream.dcp.StreamWriter) and export that") from e
        if not isinstance(stored, Stored):
            raise ValueError(f"its data.pkl holds a {type(stored).__name__}, not a tensor")
        entry = archive.getinfo(f"{root}data/{stored.storage.key}")
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, struct.error) as e:
        if isinstance(e, ExportError):
            raise
        raise ExportError(f"{what}: not a torch.save archive that can be read safely ({e}); the checkpoint is "
                          "damaged, or its chunks were written another way") from e
    if order != "little":
        raise ExportError(f"{what}: saved on a {order}-endian machine; export reads little-endian data")
    return _data_of(source, offset, entry, stored, what)


def _byteorder(archive: zipfile.ZipFile, root: str) -> str:
    try:
        info = archive.getinfo(f"{root}byteorder")
    except KeyError:
        return "little"  # archives of older torch releases (x86 and ARM machines: little-endian)
    if info.file_size > 16:
        raise ValueError("its byteorder entry is not a byte order")
    return archive.read(info).decode("ascii", "replace")


def _data_of(source: Source, offset: int, entry: zipfile.ZipInfo, stored: Stored,
             what: str) -> tuple[int, torch.dtype, tuple[int, ...]]:
    """Check the storage's entry and the tensor's layout over it; the file offset of its bytes."""
    esz = stored.dtype.itemsize
    storage_bytes = stored.storage.numel * (1 if stored.storage.dtype is None else esz)
    if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != storage_bytes:
        raise ExportError(f"{what}: its storage is compressed or not {storage_bytes} bytes; export reads stored "
                          "entries only")
    head = bytearray(_LOCAL_HEADER.size)
    if source.read_into(memoryview(head), offset + entry.header_offset) < len(head):
        raise ExportError(f"{what}: the archive ends inside a file header; the checkpoint is truncated")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(bytes(head))
    if signature != b"PK\x03\x04":
        raise ExportError(f"{what}: the archive's directory points at no file header; the checkpoint is damaged")
    numel = math.prod(stored.size)
    expected = [math.prod(stored.size[i + 1 :]) for i in range(len(stored.size))]
    if any(n > 1 and st != ex for n, st, ex in zip(stored.size, stored.stride, expected, strict=True)) \
            or len(stored.stride) != len(stored.size):
        raise ExportError(f"{what}: saved with strides {list(stored.stride)} for shape {list(stored.size)}, not "
                          "row-major; export reads row-major chunks")
    if (stored.offset + numel) * esz > storage_bytes:
        raise ExportError(f"{what}: its tensor runs past its storage's {storage_bytes} bytes; the checkpoint is "
                          "damaged")
    start = offset + entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len + stored.offset * esz
    return start, stored.dtype, stored.size
