"""The header codec: the one place that reads and writes a checkpoint's header.

A checkpoint is a safetensors file whose data section starts on a 4096-byte boundary:

    [8 bytes little-endian N][N bytes of JSON, space-padded so that 8 + N is a multiple of 4096][data]

The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
relative to the data section, tensors back to back) and "__metadata__" to str -> str pairs: the
user's, and ckptstream's own under the ``ckptstream.`` prefix:

    ckptstream.format         "1"
    ckptstream.structure      the state's structure as JSON (see _structure)
    ckptstream.crc32c         the CRC-32C of every tensor's bytes, 8 hex digits each, in file order
    ckptstream.header_crc32c  the CRC-32C of the header bytes as stored, with these 8 digits as "0"s

The checksums are known only once the data is written: ``encode`` reserves them as runs of "0"s
of fixed width and ``fill`` writes them in place, so the header keeps its length. ``decode``
validates everything (lengths, JSON, dtypes, shapes against offsets, no holes, the exact file
length, the ckptstream keys, the header's own CRC) before any tensor is allocated. Pure
functions over bytes: no file I/O here.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import json
import math
import operator
import struct
import sys
from collections.abc import Mapping
from json.encoder import encode_basestring  # what json.dumps quotes str with (not ASCII-escaped)
from typing import Any, NamedTuple, NoReturn

import torch

from .. import _checksum
from .._errors import CorruptCheckpointError, UnsupportedTypeError
from .._settings import ALIGN
from .._storage import round_up

MAX_HEADER = 100_000_000  # the limit safetensors itself applies
INT64_MAX = 2**63 - 1  # torch's sizes, strides and element counts are int64
PREFIX = "ckptstream."
FORMAT_KEY, FORMAT_VERSION = PREFIX + "format", "1"
STRUCTURE_KEY = PREFIX + "structure"
CRC_KEY = PREFIX + "crc32c"
HEADER_CRC_KEY = PREFIX + "header_crc32c"
_HEX = frozenset("0123456789abcdef")

# safetensors' dtypes in the order its writer lays tensors out (widest first; then by name)
_NAMES = {
    "U64": "uint64", "I64": "int64", "F64": "float64", "C64": "complex64",
    "F32": "float32", "U32": "uint32", "I32": "int32",
    "BF16": "bfloat16", "F16": "float16", "U16": "uint16", "I16": "int16",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
    "F4": "float4_e2m1fn_x2", "BOOL": "bool",
}  # fmt: skip
# safetensors counts F4 elements of 4 bits; torch's float4_e2m1fn_x2 packs two in one, so its
# last dimension is half the header's
_PACKED = {"F4": 2}
DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
# the torch release that added each dtype that torch>=2.4 may lack (its files need that torch)
_TORCH_SINCE = {"F8_E8M0": "2.7", "F4": "2.8"}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_DTYPE_RANK: dict[torch.dtype, int] = {v: i for i, v in enumerate(DTYPE_NAMES)}


def unnamed_hint(dtype: torch.dtype) -> str:
    """How to store a tensor of a dtype that safetensors has no name for, where there is a way."""
    if dtype.is_complex:  # complex64 has one (C64); complex128 and complex32 are pairs of named floats
        return (f": store torch.view_as_real(t) (its {dtype.to_real()} real and imaginary parts) and "
                "torch.view_as_complex() it after loading")
    return ""


class TensorInfo(NamedTuple):
    """One entry of the tensor table; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
    """A decoded, validated header."""

    tensors: list[TensorInfo]  # in file order
    metadata: dict[str, str]  # the user's (without ckptstream's own keys)
    structure: str | None  # the state's structure as JSON; None for a plain safetensors file
    crcs: list[int] | None  # stored CRC-32C per tensor in file order, if any
    data_start: int  # file offset of the data section (the header's length)

    @property
    def format(self) -> str:
        return f"ckptstream {FORMAT_VERSION}" if self.structure is not None else "safetensors"

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def data_offsets(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[TensorInfo]:
    """The tensor table of ``entries`` (name, dtype, shape) in safetensors' writer order (by
    dtype, widest first, then by name): every tensor starts aligned to its element size, and a
    flat dict gets the very offsets that ``safetensors.torch.save_file`` gives it."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
    for entry in entries:  # a stable sort by name per dtype: no key tuple per entry (files hold many)
        by_dtype.setdefault(entry[1], []).append(entry)
    infos, pos = [], 0
    for dtype in sorted(by_dtype, key=_DTYPE_RANK.__getitem__):
        itemsize = dtype.itemsize
        for name, _, shape in sorted(by_dtype[dtype], key=_name):
            nbytes = math.prod(shape) * itemsize
            infos.append(TensorInfo(name, dtype, shape, pos, pos + nbytes))
            pos += nbytes
    return infos


_name = operator.itemgetter(0)


def _header_shape(dtype: str, shape: tuple[int, ...]) -> list[int]:
    packed = _PACKED.get(dtype, 1)
    return [*shape[:-1], shape[-1] * packed] if packed > 1 else list(shape)


def check_user_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str; got {key!r}: {type(value).__name__}")
        if key.startswith(PREFIX):
            raise ValueError(f"metadata key {key!r}: keys starting with {PREFIX!r} are reserved")
        try:
            (key + value).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"metadata {key!r}: holds a character that UTF-8 cannot encode ({e.reason}); "
                             "store it as valid Unicode") from e
    return metadata


def encode(tensors: list[TensorInfo], metadata: Mapping[str, str], structure: str | None, *,
           checksums: bool) -> bytes:
    """The 8-byte length and the padded JSON header; with ``checksums``, placeholders that
    ``fill`` completes. Raises ValueError for a header over safetensors' size limit."""
    meta = dict(metadata)
    if structure is not None:
        meta.update({FORMAT_KEY: FORMAT_VERSION, STRUCTURE_KEY: structure})
    if checksums:
        meta.update({CRC_KEY: "0" * 8 * len(tensors), HEADER_CRC_KEY: "0" * 8})
    body = _table_json(tensors, meta).encode()
    size = round_up(8 + len(body), ALIGN) - 8
    if size > MAX_HEADER:
        raise ValueError(f"the header would be {size} bytes, over the {MAX_HEADER}-byte limit that safetensors "
                         "readers apply: keep large data in tensors, not in str/list leaves or metadata")
    return struct.pack("<Q", size) + body + b" " * (size - len(body))


_json = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)


def _table_json(tensors: list[TensorInfo], meta: dict[str, str]) -> str:
    """``_json({"__metadata__": meta, name: {"dtype", "shape", "data_offsets"}, ...})``, the
    same text, with each tensor's entry written from a template per dtype and shape (a file may
    hold hundreds of thousands of entries: a dict each costs more)."""
    entries: dict[str, str] = {"__metadata__": _json(meta)} if meta else {}  # an equal name replaces, as in a dict
    templates: dict[tuple[torch.dtype, tuple[int, ...]], str] = {}
    for t in tensors:
        template = templates.get((t.dtype, t.shape))
        if template is None:
            name = DTYPE_NAMES[t.dtype]
            head = _json({"dtype": name, "shape": _header_shape(name, t.shape)})
            template = templates[(t.dtype, t.shape)] = head[:-1] + ',"data_offsets":['
        entries[t.name] = f"{template}{t.begin},{t.end}]}}"
    return "{" + ",".join(f"{encode_basestring(k)}:{v}" for k, v in entries.items()) + "}"


def fill(header: bytes, crcs: list[int]) -> bytes:
    """``header`` from ``encode(..., checksums=True)`` with the tensors' CRC-32Cs and then its own."""
    out = bytearray(header)
    _put(out, CRC_KEY, "".join(f"{c:08x}" for c in crcs))
    _put(out, HEADER_CRC_KEY, f"{_checksum.crc_of(out):08x}")  # of the bytes with its own "0"s
    return bytes(out)


def _field(header: bytes | bytearray, key: str) -> int:
    """Offset of the string value of metadata field ``key``, or -1. Only the field itself
    matches: quotes inside JSON strings are escaped, and tensor entries are objects."""
    tag = f'"{key}":"'.encode()
    at = header.find(tag)
    return at + len(tag) if at >= 0 else -1


def _put(header: bytearray, key: str, value: str) -> None:
    at = _field(header, key)
    if at < 0 or header[at : at + len(value)] != b"0" * len(value):
        raise ValueError(f"the header has no placeholder for {key} of {len(value)} digits")
    header[at : at + len(value)] = value.encode()


def data_start(prefix: bytes, file_size: int, path: str) -> int:
    """The header's length (8 + N) from the file's first 8 bytes, checked against its size."""
    if file_size < 8 or len(prefix) < 8:
        raise _corrupt(path, f"file is {file_size} bytes, too short for the 8-byte header length; not a checkpoint")
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER:
        raise _corrupt(path, f"header length {n} exceeds the {MAX_HEADER}-byte limit; not a checkpoint or corrupt")
    if 8 + n > file_size:
        raise _corrupt(path, f"header length {n} runs past the end of the {file_size}-byte file; the file is truncated")
    return 8 + n


def decode(raw: bytes, file_size: int, path: str) -> Header:
    """Validate the header ``raw`` (all 8 + N bytes) of a file of ``file_size`` bytes."""
    start = data_start(raw, file_size, path)
    try:
        table = parse_json(raw[8:start].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"header is not valid JSON ({e})") from e
    if not isinstance(table, dict):
        raise _corrupt(path, f"header must be a JSON object, got {type(table).__name__}")
    meta = table.pop("__metadata__", None)
    if meta is None:  # absent, or null: safetensors writes and reads both (false, [] or "": neither)
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    sizes: _Sizes = {}  # files repeat a few shapes
    tensors = sorted((_entry(path, k, v, sizes) for k, v in table.items()), key=_BY_OFFSETS)
    pos = 0
    for t in tensors:
        if t.begin != pos:
            gap = "overlaps the previous tensor" if t.begin < pos else f"leaves a hole of {t.begin - pos} bytes"
            raise _corrupt(path, f"tensor {t.name!r} starts at data offset {t.begin}, expected {pos}: it {gap}")
        pos = t.end
    if start + pos != file_size:
        how = "truncated" if file_size < start + pos else f"followed by {file_size - start - pos} unexpected bytes"
        raise _corrupt(path, f"header declares data through byte {start + pos}, but the file is {file_size} bytes "
                             f"long: it is {how}")  # fmt: skip
    if meta.get(FORMAT_KEY, FORMAT_VERSION) != FORMAT_VERSION:
        raise _corrupt(path, f"written in ckptstream format {meta[FORMAT_KEY]!r}; this version reads format "
                             f"{FORMAT_VERSION!r} (a newer ckptstream may read it)")  # fmt: skip
    crcs = _stored_crcs(meta.get(CRC_KEY), len(tensors), path)
    if crcs is not None or HEADER_CRC_KEY in meta:
        _check_header_crc(raw[:start], meta.get(HEADER_CRC_KEY), path)
    user = {k: v for k, v in meta.items() if not k.startswith(PREFIX)}
    return Header(tensors, user, meta.get(STRUCTURE_KEY), crcs, start)


def _stored_crcs(text: str | None, count: int, path: str) -> list[int] | None:
    if text is None:
        return None
    if len(text) != 8 * count or not set(text) <= _HEX:
        raise _corrupt(path, f"{CRC_KEY} must be {8 * count} lowercase hex digits ({count} tensors), "
                             f"got {text!r:.100}")  # fmt: skip
    values = array.array("I", bytes.fromhex(text))  # 8 hex digits each, most significant first
    if sys.byteorder == "little":
        values.byteswap()
    return values.tolist()


def _check_header_crc(raw: bytes, stored: str | None, path: str) -> None:
    """Compare the header with its own CRC-32C, which covers the tensor table, the structure
    (keys and non-tensor leaves), the metadata and the tensors' checksums: none of them is
    covered by the tensors' checksums, so without it a damaged header could load as a different
    state."""
    if stored is None:
        raise _corrupt(path, f"the header has tensor checksums but no {HEADER_CRC_KEY}; it is corrupt")
    at = _field(raw, HEADER_CRC_KEY)
    if len(stored) != 8 or not set(stored) <= _HEX or at < 0 or raw[at : at + 8] != stored.encode():
        raise _corrupt(path, f"{HEADER_CRC_KEY} must be 8 lowercase hex digits, got {stored!r:.40}")
    computed = _checksum.crc_of(raw[:at] + b"0" * 8 + raw[at + 8 :])
    if computed != int(stored, 16):
        raise _corrupt(path, f"the header fails its CRC-32C check (stored {stored}, computed {computed:08x}): its "
                             "tensor table, structure or metadata is corrupt; restore it from another checkpoint "
                             "or copy")  # fmt: skip


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    table = dict(pairs)
    if len(table) != len(pairs):  # linear: a hostile header may hold a million keys
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:  # JSON leaves open which entry counts (safetensors keeps the last)
                raise ValueError(f"the key {key!r:.100} appears twice: a file that means two things is ambiguous")
            seen.add(key)
    return table


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: as non-standard as the Infinity constant
        raise ValueError(f"number {text[:40]} is out of the range of a float")
    return value


def parse_json(text: str | bytes) -> Any:
    """Strict JSON: no NaN/Infinity constants or numbers that overflow to them, no duplicate keys."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant,
                      parse_float=_finite_float)


def element_count(shape: list[int] | tuple[int, ...]) -> int | None:
    """The number of elements of a tensor of ``shape``, or None where torch cannot hold it (a
    size past int64, or, with elements, strides or an element count past int64). A hostile
    shape costs little."""
    if 0 in shape:
        return 0 if max(shape) <= INT64_MAX else None  # no elements: torch takes any sizes, given strides
    if len(shape) <= 16:  # the product of a few int64 sizes is a small number
        product = math.prod(shape)
        return product if product <= INT64_MAX else None
    product = 1
    for d in shape:
        product *= d
        if product > INT64_MAX:
            return None
    return product


_BY_OFFSETS = operator.itemgetter(3, 4)  # a TensorInfo's begin, end
# (dtype name, *shape) as a file writes them -> torch dtype, torch shape and bytes
_Sizes = dict[tuple[Any, ...], tuple[torch.dtype, tuple[int, ...], int]]


def _entry(path: str, name: str, raw: Any, sizes: _Sizes) -> TensorInfo:
    """One validated table entry; the common case costs a few checks (files hold many), and a
    dtype and shape seen before (in ``sizes``: dtype, shape and bytes as torch has them) no more."""
    try:
        # other fields: ignored, as safetensors does
        dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
        begin, end = offsets
    except (TypeError, KeyError, ValueError):
        return _bad_entry(path, name, raw)
    if (type(dtype) is not str or type(shape) is not list or type(begin) is not int or type(end) is not int
            or not 0 <= begin <= end or any(type(d) is not int or d < 0 for d in shape)):  # fmt: skip
        return _bad_entry(path, name, raw)
    key = (dtype, *shape)
    known = sizes.get(key)
    if known is None:
        known = sizes[key] = _sized(path, name, dtype, shape, raw)
    torch_dtype, torch_shape, nbytes = known
    if nbytes != end - begin:
        raise _corrupt(path, f"tensor {name!r}: shape {shape} of {dtype} needs {nbytes} bytes, "
                             f"but its data_offsets span {end - begin}")  # fmt: skip
    return TensorInfo(name, torch_dtype, torch_shape, begin, end)


def _sized(path: str, name: str, dtype: Any, shape: list[int], raw: Any) -> tuple[torch.dtype, tuple[int, ...], int]:
    """The torch dtype, torch shape and byte size of an entry's dtype and (checked) shape."""
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        return _bad_entry(path, name, raw)
    packed = _PACKED.get(dtype, 1)
    if packed > 1:
        if not shape or shape[-1] % packed:
            raise _corrupt(path, f"tensor {name!r}: {dtype} packs {packed} elements a byte: its last dimension must "
                                 f"be a multiple of {packed}, got shape {shape!r:.200}")  # fmt: skip
        torch_shape = (*shape[:-1], shape[-1] // packed)
    else:
        torch_shape = tuple(shape)
    count = element_count(torch_shape)
    if count is None:
        raise _corrupt(path, f"tensor {name!r}: shape {shape!r:.200} is too large for a tensor (past 2**63 elements "
                             "or strides)")  # fmt: skip
    return torch_dtype, torch_shape, count * torch_dtype.itemsize


def _bad_entry(path: str, name: str, raw: Any) -> NoReturn:
    """Raise the error that says what is wrong with a malformed table entry."""
    where = f"tensor {name!r}"
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= set(raw):
        raise _corrupt(path, f"{where}: expected an object with dtype, shape and data_offsets, got {raw!r:.200}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if isinstance(dtype, str) and dtype in _NAMES and dtype not in DTYPES:  # a valid file all the same
        newer = f"torch {_TORCH_SINCE[dtype]} or later" if dtype in _TORCH_SINCE else "a newer torch"
        raise UnsupportedTypeError(f"{path}: {where}: dtype {dtype} needs torch.{_NAMES[dtype]}, which torch "
                                   f"{torch.__version__} does not have; read this file with {newer}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _corrupt(path, f"{where}: unknown dtype {dtype!r:.100}; known: {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _corrupt(path, f"{where}: shape must be a list of non-negative integers, got {shape!r:.200}")
    raise _corrupt(path, f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.200}")
