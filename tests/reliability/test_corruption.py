"""Damaged files: random bit flips in the data and in the header, and truncation at random
lengths. Each case is a few-KiB file, so hundreds of cases take seconds.

What each damage must do (and nothing else: no other exception, no hang):
- a flipped data bit: load, verify and load_into raise CorruptCheckpointError naming the tensor;
  load_into's targets then hold the file's unverified bytes or their old contents;
- a flipped header bit: CorruptCheckpointError from load, verify and read_metadata;
- a truncated file: CorruptCheckpointError before any byte reaches load_into's targets.
"""

from __future__ import annotations

import random
import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from relutil import small_state, tensors_of

import ckptstream
from ckptstream import CorruptCheckpointError
from ckptstream._header import Header

CASES = 200
POISON = 0xAB
STORED_AS_VIEWS = {"model.w", "model.w_t"}  # small_state's two views of one storage
METADATA = {"run": "reliability", "note": "ünïcode ✓"}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, bytes, Header]:
    """A small checkpoint: the state, the file's bytes, its parsed header."""
    path = tmp_path_factory.mktemp("corruption") / "ckpt.safetensors"
    state = small_state(3, scale=4)
    ckptstream.save(state, path, metadata=METADATA)
    with ckptstream.open(path) as reader:
        header = reader.header
    return state, path.read_bytes(), header


def poisoned(state: Any) -> Any:
    """A copy of ``state`` whose every tensor byte is POISON (views keep sharing one storage)."""
    storages: dict[int, torch.Tensor] = {}
    copy = _clone(state, storages)
    for storage in storages.values():
        storage.fill_(POISON)
    return copy


def _clone(value: Any, storages: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = value.untyped_storage().data_ptr()
        if key not in storages:
            storages[key] = torch.empty(value.untyped_storage().nbytes(), dtype=torch.uint8)
        return torch.empty(0, dtype=value.dtype).set_(storages[key].untyped_storage(), value.storage_offset(),
                                                     value.shape, value.stride())
    if isinstance(value, dict):
        return type(value)((k, _clone(v, storages)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v, storages) for v in value)
    return value


def _is_poison(t: torch.Tensor) -> bool:
    b = t.contiguous().view(-1).view(torch.uint8)
    return bool((b == POISON).all())


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def case_of(directory: Path, data: bytes) -> Path:
    return _write(directory / "original.safetensors", data)


def _write(path: Path, data: bytes | bytearray) -> Path:
    path.write_bytes(data)
    return path


def _quick(fn: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs)
    finally:
        assert time.monotonic() - t0 < 5, f"{fn.__name__} took {time.monotonic() - t0:.1f} s"


def test_data_bit_flips_name_the_tensor(original: tuple[Any, bytes, Header], tmp_path: Path) -> None:
    state, data, header = original
    rng = random.Random(1)
    owners = [t for t in header.tensors if t.nbytes]
    with ckptstream.open(case_of(tmp_path, data)) as reader:
        keys_of = {t.name: [e.key for e in reader.entries() if e.stored_as == t.name] for t in owners}
    assert sorted(STORED_AS_VIEWS) in [sorted(k) for k in keys_of.values()]  # one blob holds both views
    case = tmp_path / "case.safetensors"
    for _ in range(CASES):
        pos = rng.randrange(header.data_start, len(data))
        owner = next(t for t in owners if t.begin <= pos - header.data_start < t.end)
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        _write(case, flipped)
        keys = keys_of[owner.name]
        targets = poisoned(state)
        for call, args in ((ckptstream.load, (case,)), (ckptstream.verify, (case,)),
                           (ckptstream.load_into, (targets, case))):
            needle = f"tensor {keys[0]!r} fails" if len(keys) == 1 else "fails"
            with pytest.raises(CorruptCheckpointError, match=f"{re.escape(needle)} its CRC-32C check") as e:
                _quick(call, *args)
            message = str(e.value)
            assert all(repr(k) in message for k in keys), (keys, message)  # by the user's key paths
            assert "__storage__" not in message, message  # never by an internal name
        # the targets hold what the file holds (unverified) or, where a view's bytes go through
        # a temporary that is only copied after the checks, their old contents
        unverified = tensors_of(ckptstream.load(case, checksum=False))
        for name, t in tensors_of(targets).items():
            if name in STORED_AS_VIEWS:
                assert _same_bytes(t, unverified[name]) or _is_poison(t), name
            else:
                assert _same_bytes(t, unverified[name]), name


def assert_rejected(path: Path, state: Any) -> None:
    """Every entry point rejects the file with CorruptCheckpointError (nothing else, quickly);
    load_into before writing any byte of its targets."""
    for call in (ckptstream.load, ckptstream.verify, ckptstream.read_metadata):
        with pytest.raises(CorruptCheckpointError):
            _quick(call, path)
    targets = poisoned(state)
    with pytest.raises(CorruptCheckpointError):
        _quick(ckptstream.load_into, targets, path)
    assert all(_is_poison(t) for t in tensors_of(targets).values()), "a target was written"


def test_header_bit_flips_are_detected(original: tuple[Any, bytes, Header], tmp_path: Path) -> None:
    """The header's own checksum covers what the tensors' checksums do not (the tensor table,
    the structure with its keys and non-tensor leaves, the metadata, the stored checksums), so
    every flipped bit is caught; none may load as a silently different state."""
    state, data, header = original
    (n,) = struct.unpack("<Q", data[:8])
    body_end = 8 + len(data[8 : 8 + n].rstrip(b" "))
    rng = random.Random(2)
    case = tmp_path / "case.safetensors"
    # the length and the JSON text, then the padding (most of a small header's bytes)
    positions = [rng.randrange(body_end) for _ in range(CASES)]
    positions += [rng.randrange(body_end, header.data_start) for _ in range(CASES // 4)]
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        assert_rejected(_write(case, flipped), state)


def test_changed_checksums_are_detected(original: tuple[Any, bytes, Header], tmp_path: Path) -> None:
    """Every stored checksum digit changed into another valid hex digit: the file is rejected."""
    _, data, header = original
    key = b'"ckptstream.crc32c":"'
    start = data.index(key) + len(key)
    case = tmp_path / "case.safetensors"
    for i in range(8 * len(header.tensors)):
        changed = bytearray(data)
        changed[start + i] = ord("1") if data[start + i] == ord("0") else ord("0")
        with pytest.raises(CorruptCheckpointError):
            ckptstream.load(_write(case, changed))


def test_truncation_fails_before_writing_anything(original: tuple[Any, bytes, Header], tmp_path: Path) -> None:
    state, data, header = original
    rng = random.Random(3)
    case = tmp_path / "case.safetensors"
    # half anywhere, half inside the data section (the other half falls mostly in the header)
    lengths = [rng.randrange(len(data)) for _ in range(CASES // 2)]
    lengths += [rng.randrange(header.data_start, len(data)) for _ in range(CASES - len(lengths))]
    for length in lengths:
        _write(case, data[:length])
        targets = poisoned(state)
        with pytest.raises(CorruptCheckpointError):
            _quick(ckptstream.load_into, targets, case)
        assert all(_is_poison(t) for t in tensors_of(targets).values()), f"a target was written (length {length})"
        with pytest.raises(CorruptCheckpointError):
            _quick(ckptstream.load, case)
        with pytest.raises(CorruptCheckpointError):
            _quick(ckptstream.verify, case)
    for extra in (b"\0", b" " * 4096, b"garbage"):  # bytes after the data are an error too
        _write(case, data + extra)
        with pytest.raises(CorruptCheckpointError, match="unexpected bytes"):
            ckptstream.load(case)
