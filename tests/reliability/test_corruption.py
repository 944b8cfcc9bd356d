"""Damaged files: random bit flips in the data and in the header, and truncation at random
lengths. Each case is a file of a few to a few tens of KiB, so hundreds of cases take seconds.

What each damage must do (and nothing else: no other exception, no hang):
- a flipped data bit: load, verify and load_into raise CorruptCheckpointError naming the tensor;
  load_into's targets that the file's bytes stream into then hold those unverified bytes, and
  those filled only after the checks (small contiguous host tensors, moved in from the scratch
  memory their run is read into; views of shared bytes; the second key of a tied tensor) their
  old contents: in a small single-chunk file, and in many chunks read by several threads, with
  small tensors gathered (the default) and streamed straight in (``gathering``);
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

import ckptstream
from ckptstream import CorruptCheckpointError, Settings
from ckptstream._checkpoint import blocks
from ckptstream._format.header import Header
from tests.helpers import direct_io_supported
from tests.reliability.fuzzutil import element_bytes
from tests.reliability.relutil import small_state, tensors_of

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


@pytest.fixture(params=["gathered", "straight"])
def gathering(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether load_into reads every small host tensor into scratch runs (the host threshold
    raised to the GPU's and runs of any length taken, so that all of this module's contiguous
    tensors are gathered) or, with the thresholds at one byte, streams every tensor straight
    into its target."""
    if request.param == "straight":
        monkeypatch.setattr(blocks, "SMALL", 1)
        monkeypatch.setattr(blocks, "HOST_SMALL", 1)
    else:
        monkeypatch.setattr(blocks, "HOST_SMALL", blocks.SMALL)
        monkeypatch.setattr(blocks, "HOST_RUN", 1)
    return bool(request.param == "gathered")


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


def test_data_bit_flips_name_the_tensor(original: tuple[Any, bytes, Header], tmp_path: Path, gathering: bool) -> None:
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
        # the targets hold what the file holds (unverified) or, where the bytes go through scratch
        # memory (small host tensors, gathered) or a temporary (views) that is only copied after
        # the checks, their old contents
        unverified = tensors_of(ckptstream.load(case, checksum=False))
        for name, t in tensors_of(targets).items():
            if name in STORED_AS_VIEWS or gathering:  # every tensor of small_state is small
                assert _is_poison(t), name
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


# --- multi-chunk loads with tied and view targets ---------------------------------------------

CHUNKY: dict[str, Any] = {"buffer_size": 4096, "num_buffers": 3, "io_threads": 3}  # ~12 chunks, 3 readers
# What a failed load_into leaves in the targets of chunky_state (docs/reliability.md, "Damaged
# files"): the file's unverified bytes, corrupt or not, in every target its bytes stream into:
# with small tensors gathered (the default), only the non-contiguous one (the others are moved in
# from scratch memory after the checks); streamed straight, every tensor's own target
STREAMED = {"model.emb", "model.b", "model.nc", "model.mask", "optim.0.exp_avg", "optim.0.step"}
STREAMED_GATHERED = {"model.nc"}
# ... and their old contents in every target filled by a copy made only after the checks: views
# of one blob (read into a temporary) and model.head, the second key of the tensor model.emb is
# stored as (unless its target is model.emb's very tensor, as tied weights in a live model are)
VIEWS = {"model.w", "model.w_t", "model.w_rows"}


def chunky_state(seed: int) -> dict[str, Any]:
    """A nested state over ~12 chunks of 4 KiB whose element boundaries fall off the chunk
    grid, with a tied tensor, three overlapping views of one storage and a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(40, 33, generator=g)
    w = torch.randn(24, 20, generator=g, dtype=torch.float64)
    return {
        "model": {
            "emb": emb,
            "head": emb,  # tied: stored once, under model.emb
            "w": w,  # three overlapping views of one storage: stored as views of one blob
            "w_t": w.t(),
            "w_rows": w[3:17],
            "b": torch.randn(1001, generator=g).to(torch.bfloat16),
            "nc": torch.randn(30, 21, generator=g).t(),  # its own storage, not contiguous: its own bytes
            "mask": torch.rand(4099, generator=g) > 0.5,
        },
        "optim": {0: {"exp_avg": torch.randn(3001, generator=g, dtype=torch.float64), "step": torch.tensor(5.0)}},
        "step": 9,
    }


def chunky_targets(state: Any, tied: bool) -> Any:
    """Poisoned targets: views sharing one storage; model.head model.emb's tensor (``tied``) or
    a tensor of its own."""
    targets = poisoned(state)
    if tied:
        targets["model"]["head"] = targets["model"]["emb"]
    else:
        targets["model"]["head"] = torch.empty_like(targets["model"]["emb"])
        targets["model"]["head"].view(torch.uint8).fill_(POISON)
    return targets


@pytest.fixture(scope="module")
def chunky(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, bytes, dict[str, tuple[int, int]]]:
    """The state, its file's bytes, and each key's byte range in the file."""
    path = tmp_path_factory.mktemp("chunky") / "ckpt.safetensors"
    state = chunky_state(5)
    ckptstream.save(state, path)
    with ckptstream.open(path) as reader:
        ranges = {e.key: (e.offset, e.end) for e in reader.entries()}
        assert [e.key for e in reader.entries() if e.view is not None] == sorted(VIEWS, key=list(ranges).index)
        assert reader.entry(("model", "head")).stored_as == "model.emb"
    return state, path.read_bytes(), ranges


def assert_failed_load_left(targets: Any, data: bytes | bytearray, ranges: dict[str, tuple[int, int]],
                            streamed: set[str]) -> None:
    """Each target in ``streamed`` holds exactly its bytes of ``data``; every other one, and the
    whole storage of the views, holds nothing but POISON."""
    for key, t in tensors_of(targets).items():
        lo, hi = ranges[key]
        if key in streamed:
            assert element_bytes(t) == bytes(data[lo:hi]), f"{key} does not hold the file's bytes"
        else:
            assert _is_poison(t), f"{key} was written before its bytes were verified"
    storage = torch.empty(0, dtype=torch.uint8).set_(targets["model"]["w"].untyped_storage())
    assert bool((storage == POISON).all()), "the views' storage was written before the checks"



def flip_positions(data: bytes, ranges: dict[str, tuple[int, int]], rng: random.Random) -> list[int]:
    """Per stored tensor: its first and last byte, the bytes on either side of each 4 KiB
    boundary inside it (where chunks split), and one at random."""
    positions = set()
    for lo, hi in set(ranges.values()):
        positions |= {lo, hi - 1, rng.randrange(lo, hi)}
        positions |= {b + d for b in range(lo // 4096 * 4096 + 4096, hi, 4096) for d in (-1, 0)}
    return sorted(p for p in positions if p < len(data))


@pytest.mark.usefixtures("jitter")  # the reading threads finish their chunks out of order
@pytest.mark.parametrize("direct_io", ["off", "on"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied_target", "own_target"])
def test_failed_multi_chunk_load_into_leaves_exact_targets(chunky: tuple[Any, bytes, dict[str, tuple[int, int]]],
                                                          tmp_path: Path, direct_io: str, tied: bool,
                                                          gathering: bool) -> None:
    """A flipped bit anywhere, loaded in many chunks by several threads: CorruptCheckpointError,
    and every target holds exactly what docs/reliability.md says (see STREAMED)."""
    state, data, ranges = chunky
    if direct_io == "on" and not direct_io_supported(tmp_path):
        pytest.skip("tmp_path's file system refuses O_DIRECT")
    options = {**CHUNKY, "direct_io": direct_io}
    streamed = STREAMED_GATHERED if gathering else STREAMED | ({"model.head"} if tied else set())
    case = _write(tmp_path / "case.safetensors", data)
    targets = chunky_targets(state, tied)
    ckptstream.load_into(targets, case, settings=Settings(**options))  # the undamaged file fills every target
    for key, t in tensors_of(targets).items():
        assert _same_bytes(t, tensors_of(state)[key]), key
    positions = flip_positions(data, ranges, random.Random(4))
    assert len(positions) >= 30
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (pos % 8)
        _write(case, flipped)
        targets = chunky_targets(state, tied)
        with pytest.raises(CorruptCheckpointError, match="fails its CRC-32C check"):
            _quick(ckptstream.load_into, targets, case, settings=Settings(**options))
        assert_failed_load_left(targets, flipped, ranges, streamed)
    every = bytearray(data)  # a bit flipped in every stored tensor at once
    for lo, hi in set(ranges.values()):
        every[(lo + hi) // 2] ^= 0x10
    _write(case, every)
    targets = chunky_targets(state, tied)
    with pytest.raises(CorruptCheckpointError):
        ckptstream.load_into(targets, case, settings=Settings(**options))
    assert_failed_load_left(targets, every, ranges, streamed)


def test_failed_load_into_streams_a_tied_tensor_into_its_first_key_the_state_has(
        chunky: tuple[Any, bytes, dict[str, tuple[int, int]]], tmp_path: Path, gathering: bool) -> None:
    """Without model.emb in the state, model.head's own target is where the tensor streams: it
    holds the unverified bytes (gathered: its old contents, as the tensor's other targets)."""
    state, data, ranges = chunky
    flipped = bytearray(data)
    flipped[ranges["model.emb"][0] + 5000] ^= 4
    case = _write(tmp_path / "case.safetensors", flipped)
    targets = chunky_targets(state, tied=False)
    del targets["model"]["emb"]
    with pytest.warns(ckptstream.StateMismatchWarning), pytest.raises(CorruptCheckpointError):
        ckptstream.load_into(targets, case, strict=False, settings=Settings(**CHUNKY))
    assert_failed_load_left(targets, flipped, ranges, STREAMED_GATHERED if gathering else STREAMED | {"model.head"})
