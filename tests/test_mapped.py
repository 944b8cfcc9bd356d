"""``load(..., mmap=True)``: CPU tensors backed by a private mapping of the file.

The mapped state equals the copying load's byte for byte (and safetensors' reading of the same
file), for the edge-case table, shared tensors and views, files of other writers whose offsets
are not aligned to their elements, and checksums computed in pieces on several threads; a
corrupt tensor is named; writes stay private; a file replaced by a save leaves the tensors
intact; the reader's descriptor is the only one, and the mapping goes with the last tensor.
"""

from __future__ import annotations

import _thread
import errno
import json
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

import ckptstream
from ckptstream import CorruptCheckpointError, TruncatedFileError, UnsupportedStorageError, _checksum
from ckptstream._checkpoint import mapped as _mapped
from ckptstream._format.header import DTYPE_NAMES
from ckptstream._storage import mapping
from ckptstream.bench import systems
from tests.helpers import (
    EDGE_CASES,
    FLOAT4,
    MiB,
    assert_bytes_equal,
    assert_same_state,
    engine_threads,
    header_of,
    needs_ctrl_c,
    open_fds,
    random_bytes,
    random_tensor,
)

# the table's dtypes that a file can hold (complex128 has no safetensors name)
STORABLE_CASES = [c for c in EDGE_CASES if c.dtype in DTYPE_NAMES]


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checksums in pieces of an odd size that splits elements, on threads, for small files."""
    monkeypatch.setattr(_mapped, "PIECE", 4096 + 7)
    monkeypatch.setattr(_mapped, "TASK", 3 * 4096)
    monkeypatch.setattr(_mapped, "THREADED_FROM", 1)
    monkeypatch.setattr(_mapped, "RELEASES_GIL", 1024)
    monkeypatch.setattr(_mapped, "threads", lambda io, hot: 3)


def is_mapped(t: torch.Tensor, path: Path) -> bool:
    """Whether ``t``'s bytes lie in a mapping of ``path`` (per /proc/self/maps)."""
    ptr, target = t.data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and fields[5].strip() == target
    return False


def mappings_of(path: Path) -> int:
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(" " + target))


def write_foreign(path: Path, tensors: list[tuple[str, str, list[int], bytes]], pad: int) -> Path:
    """A safetensors file written by hand: tensors back to back in the given order, the header
    ``pad`` spaces longer, so that offsets are as unaligned as asked."""
    table: dict[str, Any] = {}
    pos = 0
    for name, dtype, shape, data in tensors:
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    body = json.dumps(table, separators=(",", ":")).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"".join(d for *_, d in tensors))
    return path


# --- the same state as a copying load ---------------------------------------------------------


def test_edge_cases_load_as_the_copying_load_and_safetensors(tmp_path: Path) -> None:
    state = {c.name: c.source("cpu") for c in STORABLE_CASES}
    path = tmp_path / "edge.safetensors"
    ckptstream.save(state, path)
    mapped = ckptstream.load(path, mmap=True)
    assert_same_state(mapped, ckptstream.load(path), device="cpu")
    assert_same_state(mapped, {k: v.contiguous() for k, v in state.items()}, device="cpu")
    with safetensors.safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            assert_bytes_equal(mapped[key], f.get_tensor(key))
    for key, t in mapped.items():
        if t.numel():
            assert is_mapped(t, path), key  # no copy: the file's pages themselves
            assert t.data_ptr() % t.element_size() == 0, key


def test_nested_state_with_shared_tensors_and_views(tmp_path: Path, small_pieces: None) -> None:
    base = random_tensor((64, 48))
    w = random_tensor((300,), torch.bfloat16)
    state = {"model": {"w": w, "tied": w, "rows": base[3:20], "cols": base.t()[5], "base": base},
             "optim": [{"step": 7, "m": random_tensor((5, 5), torch.float64)}, (random_tensor((0, 3)), None)],
             "lr": 0.5}
    if FLOAT4 is not None:  # torch 2.8+
        state["fp4"] = random_tensor((4, 6), FLOAT4)
    path = tmp_path / "nested.safetensors"
    ckptstream.save(state, path)
    mapped = ckptstream.load(path, mmap=True)
    assert_same_state(mapped, ckptstream.load(path), device="cpu")
    assert_same_state(mapped, state, device="cpu")
    m = mapped["model"]
    assert m["w"] is m["tied"]
    assert m["rows"].untyped_storage().data_ptr() == m["base"].untyped_storage().data_ptr()
    assert m["cols"].untyped_storage().data_ptr() == m["base"].untyped_storage().data_ptr()
    m["base"][4, 0] = 1234.5  # a view sees its base's writes, as after a copying load
    assert m["rows"][1, 0].item() == 1234.5


def test_reader_load_with_mmap(tmp_path: Path) -> None:
    state = {"a": random_tensor((1000,)), "b": {"c": random_tensor((3, 7), torch.int16)}, "step": 3}
    ckptstream.save(state, tmp_path / "s.safetensors")
    with ckptstream.open(tmp_path / "s.safetensors") as reader:
        mapped = reader.load(mmap=True)
    assert_same_state(mapped, state, device="cpu")


def test_large_tensors_are_checksummed_in_pieces_on_threads(tmp_path: Path) -> None:
    # the real piece size: a tensor of several pieces, with one of a single piece beside it
    big = random_tensor((_mapped.PIECE * 2 + 12_345) // 4)
    state = {"big": big, "small": random_tensor((77,), torch.float16)}
    ckptstream.save(state, tmp_path / "big.safetensors")
    assert _mapped.threads(1, 16) == min(16, os.cpu_count() or 1)
    assert_same_state(ckptstream.load(tmp_path / "big.safetensors", mmap=True), state, device="cpu")
    assert engine_threads() == []


def test_file_without_tensors_or_bytes(tmp_path: Path) -> None:
    state = {"empty": torch.empty(0, 5), "step": 1}
    ckptstream.save(state, tmp_path / "e.safetensors")
    assert_same_state(ckptstream.load(tmp_path / "e.safetensors", mmap=True), state, device="cpu")
    ckptstream.save({"step": 2}, tmp_path / "none.safetensors")
    assert ckptstream.load(tmp_path / "none.safetensors", mmap=True) == {"step": 2}


# --- files of other writers -------------------------------------------------------------------


def test_foreign_file_with_unaligned_offsets(tmp_path: Path, small_pieces: None) -> None:
    a = random_bytes(3).numpy().tobytes()
    f32 = random_tensor((5, 3))
    f64 = random_tensor((9,), torch.float64)
    i16 = random_tensor((7,), torch.int16)
    tensors = [("a", "U8", [3], a), ("f32", "F32", [5, 3], f32.numpy().tobytes()),
               ("f64", "F64", [9], f64.numpy().tobytes()), ("i16", "I16", [7], i16.numpy().tobytes()),
               ("none", "F32", [0, 4], b"")]
    if FLOAT4 is not None:  # torch 2.8+
        f4 = random_tensor((2, 3), FLOAT4)
        tensors.insert(4, ("f4", "F4", [2, 6], f4.view(torch.uint8).numpy().tobytes()))
    path = write_foreign(tmp_path / "foreign.safetensors", tensors, pad=1)
    start, header = header_of(path)
    assert (start + header["f32"]["data_offsets"][0]) % 4 != 0  # the case under test
    mapped = ckptstream.load(path, mmap=True)
    expected = {"a": torch.frombuffer(bytearray(a), dtype=torch.uint8), "f32": f32, "f64": f64, "i16": i16,
                "none": torch.empty(0, 4), **({"f4": f4} if FLOAT4 is not None else {})}
    assert set(mapped) == set(expected)
    for key, t in expected.items():
        assert_bytes_equal(mapped[key], t)
        assert mapped[key].data_ptr() % mapped[key].element_size() == 0, key  # unaligned ones are copied
    assert_same_state(mapped, ckptstream.load(path), device="cpu")
    with safetensors.safe_open(str(path), "pt") as f:
        for key in ("a", "f32", "f64", "i16", "none"):
            assert_bytes_equal(mapped[key], f.get_tensor(key))
    mapped["f64"] += 1  # a copied tensor is writable too
    assert is_mapped(mapped["a"], path)


def test_file_of_safetensors_save_file(tmp_path: Path) -> None:
    state = {"x": random_tensor((33, 5)), "y": random_tensor((8,), torch.bfloat16), "z": random_tensor((0,))}
    safetensors.torch.save_file(state, str(tmp_path / "st.safetensors"))
    mapped = ckptstream.load(tmp_path / "st.safetensors", mmap=True)  # no checksums stored: none to verify
    assert_same_state(dict(sorted(mapped.items())), dict(sorted(state.items())), device="cpu")


# --- checksums --------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_corrupt_byte_names_its_tensor(tmp_path: Path, small_pieces: None, where: str) -> None:
    state = {"head": random_tensor((100,)), "target": random_tensor((5000,), torch.float64),
             "tail": random_tensor((30,), torch.int8)}
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    start, header = header_of(path)
    lo, hi = header["target"]["data_offsets"]
    at = start + {"first": lo, "middle": (lo + hi) // 2 + 3, "last": hi - 1}[where]
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=rf"{path}: tensor 'target' fails its CRC-32C check"):
        ckptstream.load(path, mmap=True)
    assert engine_threads() == []
    damaged = ckptstream.load(path, mmap=True, checksum=False)  # the damage is visible, not hidden
    assert damaged["target"].view(torch.uint8).reshape(-1)[at - start - lo].item() == raw[at]


def test_corrupt_shared_data_names_every_key(tmp_path: Path) -> None:
    base = random_tensor((40,))
    ckptstream.save({"m": {"a": base[:10], "b": base[5:]}}, tmp_path / "v.safetensors")
    path = tmp_path / "v.safetensors"
    start, header = header_of(path)
    (name,) = [k for k in header if k != "__metadata__"]
    raw = bytearray(path.read_bytes())
    raw[start + header[name]["data_offsets"][0] + 8] ^= 1
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=r"the shared data of tensors \['m.a', 'm.b'\]"):
        ckptstream.load(path, mmap=True)


def test_without_checksums_nothing_is_read_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"a": random_tensor((50_000,)), "b": random_tensor((9,), torch.int64)}
    ckptstream.save(state, tmp_path / "s.safetensors")

    def no_reads(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read up front")

    monkeypatch.setattr(_mapped, "span_crcs", no_reads)  # the data's checksums (not the header's)
    monkeypatch.setattr(mapping.Mapping, "prefetch", no_reads)
    assert_same_state(ckptstream.load(tmp_path / "s.safetensors", mmap=True, checksum=False), state, device="cpu")
    with pytest.raises(AssertionError, match="read up front"):
        ckptstream.load(tmp_path / "s.safetensors", mmap=True)


# --- the mapping's life -----------------------------------------------------------------------


def test_writes_to_the_tensors_stay_private(tmp_path: Path) -> None:
    state = {"w": random_tensor((4096,)), "i": random_tensor((100,), torch.int32)}
    path = tmp_path / "w.safetensors"
    ckptstream.save(state, path)
    before = path.read_bytes()
    mapped = ckptstream.load(path, mmap=True)
    mapped["w"].mul_(3).add_(1)
    mapped["i"].fill_(7)
    assert mapped["i"].eq(7).all()
    assert path.read_bytes() == before
    assert_same_state(ckptstream.load(path, mmap=True), state, device="cpu")
    assert_same_state(ckptstream.load(path), state, device="cpu")


def test_a_file_replaced_by_a_save_leaves_the_tensors_intact(tmp_path: Path) -> None:
    old = {"w": random_tensor((300_000,)), "b": random_tensor((17,), torch.bfloat16)}
    path = tmp_path / "r.safetensors"
    ckptstream.save(old, path)
    mapped = ckptstream.load(path, mmap=True, checksum=False)  # nothing read yet
    new = {"w": random_tensor((300_000,)), "b": random_tensor((17,), torch.bfloat16)}
    ckptstream.save(new, path)  # a new file renamed over the old one
    assert_same_state(mapped, old, device="cpu")
    assert_same_state(ckptstream.load(path, mmap=True), new, device="cpu")


def test_no_descriptor_stays_open_and_the_mapping_goes_with_the_tensors(tmp_path: Path) -> None:
    state = {"a": random_tensor((20_000,)), "b": random_tensor((3, 3), torch.float64)}
    path = tmp_path / "fd.safetensors"
    ckptstream.save(state, path)
    fds = open_fds()
    with ckptstream.open(path) as reader:
        mapped = reader.load(mmap=True)
        assert len(open_fds()) == len(fds) + 1  # the reader's own
    assert open_fds() == fds
    also = ckptstream.load(path, mmap=True)
    assert open_fds() == fds
    assert mappings_of(path) == 2
    a = mapped["a"]
    del mapped
    assert mappings_of(path) == 2  # one tensor keeps its mapping
    assert_bytes_equal(a, state["a"])
    del a, also
    assert mappings_of(path) == 0


def test_a_file_truncated_after_its_header_was_read(tmp_path: Path) -> None:
    ckptstream.save({"a": random_tensor((5000,))}, tmp_path / "t.safetensors")
    with ckptstream.open(tmp_path / "t.safetensors") as reader:
        os.truncate(tmp_path / "t.safetensors", os.path.getsize(tmp_path / "t.safetensors") - 100)
        with pytest.raises(TruncatedFileError, match=r"t\.safetensors is too short"):
            reader.load(mmap=True, checksum=False)
    assert mappings_of(tmp_path / "t.safetensors") == 0


# --- devices, progress, the benchmark ---------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, "meta", torch.device("meta")])
def test_a_device_other_than_the_cpu_is_refused(tmp_path: Path, device: Any) -> None:
    ckptstream.save({"a": random_tensor((10,))}, tmp_path / "d.safetensors")
    with pytest.raises(ValueError, match=r"mmap=True .* device='cpu'"):
        ckptstream.load(tmp_path / "d.safetensors", device=device, mmap=True)
    if str(device) == "meta":
        with ckptstream.open(tmp_path / "d.safetensors") as reader, pytest.raises(ValueError, match="device='cpu'"):
            reader.load(device=device, mmap=True)


def test_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    state = {"a": random_tensor((MiB,))}
    ckptstream.save(state, tmp_path / "p.safetensors")
    assert_same_state(ckptstream.load(tmp_path / "p.safetensors", mmap=True, progress=True), state, device="cpu")
    assert "load p.safetensors" in capfd.readouterr().err


def test_the_benchmark_lists_the_copying_load_on_cpu_runs_only() -> None:
    system = systems.SYSTEMS["ckptstream"]
    assert "ckptstream mmap=False" in [v.label for v in system.variants_on("cpu")]
    assert "ckptstream mmap=False" not in [v.label for v in system.variants_on("cuda:1")]
    others = [v.label for v in system.variants if v.label != "ckptstream mmap=False"]
    assert [v.label for v in system.variants_on("cuda")] == others


# --- the default CPU load maps; mmap=False copies -----------------------------------------------


def mixed_state() -> dict[str, torch.Tensor]:
    """Large tensors (their checksums release the GIL: the threads' tasks) between runs of small
    ones (the caller's thread), more than THREADED_FROM bytes of large ones in all."""
    state: dict[str, torch.Tensor] = {}
    for i in range(6):
        state[f"big{i}"] = random_tensor(((_mapped.THREADED_FROM // 4 + 1_000_003 * i) // 4,))
        state[f"bias{i}"] = random_tensor((37 + i,), torch.bfloat16)
        state[f"norm{i}"] = random_tensor((3, 5), torch.float64)
    return state


def test_the_default_cpu_load_maps_the_file_and_mmap_false_copies(tmp_path: Path) -> None:
    state = {c.name: c.source("cpu") for c in STORABLE_CASES}
    path = tmp_path / "edge.safetensors"
    ckptstream.save(state, path)
    expected = {k: v.contiguous() for k, v in state.items()}
    default = ckptstream.load(path)
    copied = ckptstream.load(path, mmap=False)
    with ckptstream.open(path) as reader:
        by_reader = reader.load()
    for loaded in (default, copied, by_reader):
        assert_same_state(loaded, expected, device="cpu")
    for key in expected:
        if expected[key].numel():
            assert is_mapped(default[key], path), key
            assert is_mapped(by_reader[key], path), key
            assert not is_mapped(copied[key], path), key
    copied["dtype_float32"].add_(1)  # owned memory: writable, and the file does not change
    assert_same_state(ckptstream.load(path), expected, device="cpu")


def test_the_default_load_verifies_on_threads_and_in_the_callers_thread(tmp_path: Path) -> None:
    # the real thresholds: the large tensors go to the threads' tasks, the small ones to the caller
    state = mixed_state()
    path = tmp_path / "mixed.safetensors"
    ckptstream.save(state, path)
    assert_same_state(ckptstream.load(path), state, device="cpu")
    assert engine_threads() == []
    raw = path.read_bytes()
    start, header = header_of(path)
    for key in ("big3", "bias4", "norm0", "big5"):
        hi = header[key]["data_offsets"][1]
        damaged = bytearray(raw)
        damaged[start + hi - 1] ^= 0x40
        path.write_bytes(damaged)
        with pytest.raises(CorruptCheckpointError, match=rf"tensor '{key}' fails its CRC-32C check"):
            ckptstream.load(path)
        assert engine_threads() == []


def test_span_checksums_of_every_kind_of_piece(small_pieces: None) -> None:
    data = random_bytes(300_000).numpy().tobytes()
    region = bytearray(data)
    spans = [(0, 0), (0, 700), (700, 900), (1000, 60_000), (60_000, 60_001), (60_001, 200_000),
             (200_000, 200_100), (200_200, 300_000)]  # empty, small, large, holes between
    calls: list[str] = []

    class Region:
        buffer = region

        def prefetch(self, lo: int, hi: int) -> bool:
            calls.append(f"prefetch {lo}")
            return False

        def resident(self, lo: int, hi: int) -> bool:
            return lo % 2 == 0  # some tasks' pages in the page cache, others not

    def build(share: Any) -> str:
        share()
        return "built"

    crcs, out = _mapped.span_crcs(Region(), spans, 3, meanwhile=build)
    assert out == "built"
    assert crcs == [_checksum.crc_of(data[lo:hi]) for lo, hi in spans]
    assert calls
    assert all(int(c.split()[1]) % 2 for c in calls)  # only the tasks not resident were brought in
    crcs, out = _mapped.span_crcs(Region(), spans, 1)
    assert out is None
    assert crcs == [_checksum.crc_of(data[lo:hi]) for lo, hi in spans]


def test_a_failure_while_the_state_is_built_stops_and_joins_the_checksum_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mixed.safetensors"
    ckptstream.save(mixed_state(), path)
    real = _mapped._tensor

    def fail_on_a_bias(region: Any, info: Any, at: int) -> torch.Tensor:
        if info.name == "bias2":
            raise RuntimeError("planted")
        return real(region, info, at)

    monkeypatch.setattr(_mapped, "_tensor", fail_on_a_bias)
    with pytest.raises(RuntimeError, match="planted"):
        ckptstream.load(path)
    assert engine_threads() == []
    assert mappings_of(path) == 0


def test_a_storage_that_cannot_map_gets_the_copying_load_by_default(mem: Any) -> None:
    state = {"w": random_tensor((5000,)), "n": {"b": random_tensor((7,), torch.int16)}, "step": 4}
    ckptstream.save(state, "mem://test/m.safetensors")
    assert_same_state(ckptstream.load("mem://test/m.safetensors"), state, device="cpu")
    with pytest.raises(UnsupportedStorageError, match="mmap=True"):
        ckptstream.load("mem://test/m.safetensors", mmap=True)


def test_a_file_system_that_refuses_mappings_gets_the_copying_load_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": random_tensor((5000,)), "b": random_tensor((7,), torch.int16)}
    path = tmp_path / "nomap.safetensors"
    ckptstream.save(state, path)

    def refuse(*args: Any) -> None:
        raise OSError(errno.ENODEV, "No such device (mmap refused)")

    monkeypatch.setattr(mapping.Mapping, "__init__", refuse)
    loaded = ckptstream.load(path)
    assert_same_state(loaded, state, device="cpu")
    assert not is_mapped(loaded["w"], path)
    with pytest.raises(OSError, match="mmap refused"):
        ckptstream.load(path, mmap=True)


def test_ctrl_c_during_the_checksums_stops_and_joins_every_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_ctrl_c()
    path = tmp_path / "mixed.safetensors"
    ckptstream.save(mixed_state(), path)
    real, calls = _checksum.crc_of, []
    interrupt_at = 3

    def counting(data: Any) -> int:
        calls.append(threading.current_thread().name)
        if len(calls) == interrupt_at:
            _thread.interrupt_main()  # as Ctrl-C does, whichever thread checksums now
        return real(data)

    monkeypatch.setattr(_checksum, "crc_of", counting)
    interrupt_at = 0
    ckptstream.load(path)  # counts the checksum calls of a whole load
    whole, interrupt_at = len(calls), 3
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        ckptstream.load(path)
    assert len(calls) < whole  # stopped early: not every piece was checksummed
    assert engine_threads() == []
    assert mappings_of(path) == 0
