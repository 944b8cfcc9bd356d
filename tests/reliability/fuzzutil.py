"""The property every header fuzzer checks, shared by the hypothesis tests and the atheris
harness: decoding the header, opening the reader, and loading any byte string raise nothing
but CkptStreamError subclasses, allocate nothing sized by what the header announces, and
return quickly (check_file); and, for files known to be invalid, that every reader rejects
them with CorruptCheckpointError (check_rejected)."""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import ckptstream
from ckptstream import CkptStreamError, CorruptCheckpointError, StateMismatchWarning
from ckptstream._format import header

SECONDS = 1.0
# Python objects built from a parsed header take a bounded multiple of its bytes (a 3-byte "[]," is
# a 56-byte list), plus a constant for the machinery; nothing may be sized by a number it announces.
PY_FACTOR, PY_CONSTANT = 64, 1 << 20


def frame(body: bytes, data: bytes = b"", declared: int | None = None, pad: bool = True) -> bytes:
    """A file: the 8-byte length, the header (space-padded to 4096 like ours, if ``pad``), the data."""
    if pad:
        body += b" " * (-(8 + len(body)) % 4096)
    return struct.pack("<Q", len(body) if declared is None else declared) + body + data


def encode_header(table: Any) -> bytes:
    return json.dumps(table, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _decode_header(path: str) -> None:
    """The header codec alone, on the file's first bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = header.data_start(f.read(8), size, path)
        f.seek(0)
        header.decode(f.read(start), size, path)


def _open_reader(path: str) -> None:
    """The lazy reader: its index, non-tensor leaves and skeleton, without reading any data."""
    with ckptstream.open(path) as reader:
        reader.entries()
        reader.leaves  # noqa: B018 (a property that walks the structure)
        reader.skeleton()


def _load_into(path: str) -> None:
    ckptstream.load_into({}, path, strict=False)


# the public readers (each parses the whole header, the structure included), and the codec alone
READERS: list[Callable[[str], Any]] = [_open_reader, ckptstream.read_metadata, ckptstream.verify, ckptstream.load,
                                       _load_into]  # fmt: skip
ENTRY_POINTS: list[Callable[[str], Any]] = [_decode_header, *READERS]


@contextmanager
def torch_allocations() -> Iterator[list[int]]:
    """Bytes of every tensor torch.empty creates meanwhile (the only way the readers allocate)."""
    counted = [0]
    original = torch.empty

    def counting_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = original(*args, **kwargs)
        counted[0] += t.numel() * t.element_size()
        return t

    torch.empty = counting_empty
    try:
        yield counted
    finally:
        torch.empty = original


def check_file(path: str) -> None:
    """Run every entry point on ``path`` and check the property; raise AssertionError if not.
    Each call runs twice: timed as it is, then under tracemalloc (which slows it down) to
    measure what it allocates."""
    size = os.stat(path).st_size
    for call in ENTRY_POINTS:
        name = getattr(call, "__name__", repr(call))
        t0 = time.monotonic()
        _call(call, path)
        elapsed = time.monotonic() - t0
        assert elapsed < SECONDS, f"{name} took {elapsed:.2f} s on a {size}-byte file"
        tracemalloc.start()
        try:
            with torch_allocations() as tensor_bytes:
                _call(call, path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert tensor_bytes[0] <= size, f"{name} allocated {tensor_bytes[0]} tensor bytes for a {size}-byte file"
        assert peak <= PY_FACTOR * size + PY_CONSTANT, f"{name} allocated {peak} bytes for a {size}-byte file"


def check_rejected(path: str, *, in_table: bool) -> None:
    """Every reader rejects the file with CorruptCheckpointError: none accepts it, none raises
    anything else. ``in_table``: the fault is in the tensor table, so the header codec alone
    rejects it too (a fault in the structure only shows once a reader parses that)."""
    for call in ENTRY_POINTS if in_table else READERS:
        name = getattr(call, "__name__", repr(call))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StateMismatchWarning)
            try:
                call(path)
            except CorruptCheckpointError:
                continue
            except BaseException as e:
                raise AssertionError(f"{name} raised {type(e).__name__}: {e}") from e
        raise AssertionError(f"{name} accepted {path}")


def element_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in row-major order, as stored: copied as integers of the same
    size (a copy as booleans or floats may change them), into a fresh tensor (``contiguous()``
    keeps the odd strides of size-1 dimensions, which no byte view takes)."""
    if not t.numel():
        return b""
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    dense = torch.empty(t.shape, dtype=same_size).copy_(t.detach().cpu().view(same_size))
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def _call(call: Callable[[str], Any], path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StateMismatchWarning)  # load_into(strict=False) skipping keys
        try:
            call(path)
        except CkptStreamError:
            pass
        except BaseException as e:
            name = getattr(call, "__name__", repr(call))
            raise AssertionError(f"{name} raised {type(e).__name__}: {e}") from e
