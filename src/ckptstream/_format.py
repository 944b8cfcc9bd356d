"""The file format: a safetensors file whose data section starts on a 4096-byte boundary.

    [8 bytes little-endian N][N bytes of JSON, space-padded so that 8 + N is a multiple of 4096][data]

The header is validated completely (lengths, JSON, dtypes, shapes against offsets, contiguity,
exact file length) before any tensor is allocated or any device work starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any

import torch

from ._errors import CorruptCheckpointError
from ._fileio import ALIGN, pread_into, round_up

MAX_HEADER = 100_000_000  # the limit safetensors itself applies
INT64_MAX = 2**63 - 1  # torch's sizes, strides and element counts are int64

# safetensors' dtypes in the order its writer lays tensors out (widest first; then by name)
_NAMES = {
    "U64": "uint64", "I64": "int64", "F64": "float64", "C64": "complex64",
    "F32": "float32", "U32": "uint32", "I32": "int32",
    "BF16": "bfloat16", "F16": "float16", "U16": "uint16", "I16": "int16",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
DTYPE_RANK: dict[torch.dtype, int] = {v: i for i, v in enumerate(DTYPE_NAMES)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass
class Header:
    tensors: list[TensorInfo]  # in file order
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section


def layout(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[TensorInfo]:
    """Offsets for tensors stored back to back in the given order."""
    infos, pos = [], 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        infos.append(TensorInfo(name, dtype, shape, pos, pos + nbytes))
        pos += nbytes
    return infos


def encode(tensors: list[TensorInfo], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the padded JSON header."""
    table: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for t in tensors:
        table[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    body = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
    size = round_up(8 + len(body), ALIGN) - 8
    return struct.pack("<Q", size) + body + b" " * (size - len(body))


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    table = dict(pairs)
    if len(table) != len(pairs):  # linear: a hostile header may hold a million keys
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return table


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def parse_json(text: str | bytes) -> Any:
    """Strict JSON: no NaN/Infinity constants, no duplicate keys."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def element_count(shape: list[int] | tuple[int, ...]) -> int | None:
    """The number of elements of a tensor of ``shape``, or None where torch cannot hold it (its
    sizes, strides or element count past int64). Stops early, so a hostile shape costs little."""
    product = 1
    for d in shape:
        product *= max(d, 1)  # what torch's contiguous strides multiply
        if product > INT64_MAX:
            return None
    return 0 if 0 in shape else product


def _entry(path: str, name: str, raw: Any) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(path, f"{where}: expected an object with dtype, shape and data_offsets, got {raw!r:.200}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _corrupt(path, f"{where}: unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _corrupt(path, f"{where}: shape must be a list of non-negative integers, got {shape!r:.200}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):  # fmt: skip
        raise _corrupt(path, f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.200}")
    info = TensorInfo(name, DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
    count = element_count(shape)
    if count is None:
        raise _corrupt(path, f"{where}: shape {shape!r:.200} is too large for a tensor (past 2**63 elements or strides)")
    expected = count * info.dtype.itemsize
    if expected != info.nbytes:
        raise _corrupt(path, f"{where}: shape {list(info.shape)} of {dtype} needs {expected} bytes, "
                             f"but its data_offsets span {info.nbytes}")  # fmt: skip
    return info


def read_header(fd: int, path: str) -> Header:
    """Read and validate the header of an open file; raises CorruptCheckpointError."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise _corrupt(path, f"file is {size} bytes, too short for the 8-byte header length; not a checkpoint")
    prefix = bytearray(8)
    pread_into(fd, memoryview(prefix), 0, path)
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER:
        raise _corrupt(path, f"header length {n} exceeds the {MAX_HEADER}-byte limit; not a checkpoint or corrupt")
    if 8 + n > size:
        raise _corrupt(path, f"header length {n} runs past the end of the {size}-byte file; the file is truncated")
    raw = bytearray(n)
    pread_into(fd, memoryview(raw), 8, path)
    try:
        table = parse_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"header is not valid JSON ({e})") from e
    if not isinstance(table, dict):
        raise _corrupt(path, f"header must be a JSON object, got {type(table).__name__}")
    metadata = table.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    tensors = sorted((_entry(path, k, v) for k, v in table.items()), key=lambda t: (t.begin, t.end))
    pos = 0
    for t in tensors:
        if t.begin != pos:
            gap = "overlaps the previous tensor" if t.begin < pos else f"leaves a hole of {t.begin - pos} bytes"
            raise _corrupt(path, f"tensor {t.name!r} starts at data offset {t.begin}, expected {pos}: it {gap}")
        pos = t.end
    if 8 + n + pos != size:
        how = "truncated" if size < 8 + n + pos else f"followed by {size - 8 - n - pos} unexpected bytes"
        raise _corrupt(path, f"header declares data through byte {8 + n + pos}, but the file is {size} bytes "
                             f"long: it is {how}")  # fmt: skip
    return Header(tensors, metadata, 8 + n)
