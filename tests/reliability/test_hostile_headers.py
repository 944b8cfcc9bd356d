"""Crafted headers with consistent checksums: a view that describes far more than its bytes
(``_structure.view_limit``), int keys that all hash alike, and headers whose parsing must stay
linear in their size, in time and in memory (a small multiple of the header, measured in a child
process)."""

from __future__ import annotations

import gc
import json
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import CorruptCheckpointError, cli
from ckptstream._format import structure as _structure
from tests.helpers import craft_checkpoint

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def header_size(path: Path) -> int:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return int(n)


# --- views: at most view_limit(blob) bytes described ------------------------------------------


def _with_view(tmp_path: Path, base_bytes: int, view: list[Any]) -> Path:
    data = bytes((i * 7 + 1) % 251 for i in range(base_bytes))
    structure = json.dumps({"dict": [["w", {"tensor": "w"}], ["v", {"view": ["w", *view]}]]})
    return craft_checkpoint(tmp_path / "v.safetensors", [("w", "U8", [base_bytes], data)], structure)


@pytest.mark.parametrize(("base", "view"), [
    (4096, ["F32", [2**31, 2**31], [0, 0], 0]),  # 2**64 bytes over 4 KiB
    (4096, ["F32", [2**20 + 1], [0], 0]),  # one element past 1024 x 4 KiB
    (4, ["U8", [MiB + 1], [0], 0]),  # one byte past the floor of 1 MiB
    (4096, ["F64", [3, 2**40], [1, 0], 8]),  # three elements, each repeated 2**40 times
], ids=["2**31x2**31", "just_past_1024x", "just_past_the_floor", "expanded_rows"])  # fmt: skip
def test_a_view_past_the_limit_is_corrupt_everywhere(base: int, view: list[Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _with_view(tmp_path, base, view)
    limit = _structure.view_limit(base)
    expected = rf"'v': a view of shape .* past the limit of {limit}: the file is crafted or corrupt"
    with pytest.raises(CorruptCheckpointError, match=expected):
        ckptstream.load(path)
    with pytest.raises(CorruptCheckpointError, match=expected):
        ckptstream.verify(path)
    with pytest.raises(CorruptCheckpointError, match=expected):
        ckptstream.open(path)
    with pytest.raises(CorruptCheckpointError, match=expected):
        ckptstream.load_into({"w": torch.empty(base, dtype=torch.uint8)}, path, strict=False)
    assert cli.main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"past the limit of {limit}" in err
    assert "GiB" not in err


@pytest.mark.parametrize(("base", "view"), [
    (4096, ["F32", [2**20], [0], 0]),  # exactly 1024 x 4 KiB
    (4, ["U8", [MiB], [0], 0]),  # exactly the floor
    (4096, ["F32", [8, 1024], [0, 1], 0]),  # the whole base, 8 times
], ids=["exactly_1024x", "exactly_the_floor", "expanded_8x"])  # fmt: skip
def test_a_view_within_the_limit_loads_without_allocating(base: int, view: list[Any], tmp_path: Path) -> None:
    path = _with_view(tmp_path, base, view)
    state = ckptstream.load(path)
    v, w = state["v"], state["w"]
    assert v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()  # a view: nothing allocated
    assert v.numel() * v.element_size() <= _structure.view_limit(base)
    assert torch.equal(v.reshape(-1)[:1], w[: v.element_size()].clone().view(v.dtype))  # its first element
    with ckptstream.open(path) as reader:
        assert reader.entry("v").view is not None


def test_an_expanded_view_within_the_limit_round_trips_sharing_memory(tmp_path: Path) -> None:
    n = 1000
    t = torch.randn(n)
    state = {"m": {"a": t, "b": t.expand(4, n)}, "step": 1}
    path = tmp_path / "e.safetensors"
    ckptstream.save(state, path)
    with ckptstream.open(path) as reader:
        assert reader.header.data_bytes == n * 4  # t's bytes, once
        assert reader.entry("m.b").view is not None
        assert reader.entry("m.b").stored_as == "m.a.__storage__"
    back = ckptstream.load(path)
    assert torch.equal(back["m"]["a"], t)
    assert torch.equal(back["m"]["b"], t.expand(4, n))
    assert back["m"]["b"].stride() == (0, 1)
    assert back["m"]["b"].untyped_storage().data_ptr() == back["m"]["a"].untyped_storage().data_ptr()


def test_an_expanded_view_past_the_limit_is_saved_as_its_own_bytes(tmp_path: Path) -> None:
    t = torch.randn(16)
    big = t[:1].expand(300_000)  # 1.2 MB described over the 64 bytes they share: past view_limit(64)
    assert big.numel() * 4 > _structure.view_limit(64)
    state = {"m": {"a": t, "b": big, "c": t[4:8]}}
    path = tmp_path / "big.safetensors"
    ckptstream.save(state, path)
    with ckptstream.open(path) as reader:
        assert reader.entry("m.b").view is None
        assert reader.entry("m.b").stored_as == "m.b"
        assert reader.entry("m.a").view is not None  # the others still share a blob
        assert reader.entry("m.c").stored_as == reader.entry("m.a").stored_as
    back = ckptstream.load(path)
    for key in "abc":
        assert torch.equal(back["m"][key], state["m"][key])
    assert back["m"]["c"].untyped_storage().data_ptr() == back["m"]["a"].untyped_storage().data_ptr()


def test_a_view_judged_by_the_blob_it_is_stored_in(tmp_path: Path) -> None:
    """The limit a load applies is the blob's: a save that stores one view as its own bytes
    shrinks the blob of the others, and must judge them by that smaller blob (or it writes a
    file that its own load refuses)."""
    t = torch.randn(512)  # 2 KiB
    wide = t.as_strided((512, 1100), (1, 0))  # spans all 2 KiB, describes 2.25 MB: its own bytes
    repeated = t[:1].expand(300_000)  # 1.2 MB over 4 bytes: within 1024 x 2 KiB, not within the floor
    state = {"m": {"wide": wide, "repeated": repeated, "head": t[:4]}}
    path = tmp_path / "s.safetensors"
    ckptstream.save(state, path)
    back = ckptstream.load(path)
    for key, value in state["m"].items():
        assert torch.equal(back["m"][key], value)
    with ckptstream.open(path) as reader:
        for key in ("wide", "repeated"):
            assert reader.entry(f"m.{key}").view is None


# --- int keys that all hash alike ---------------------------------------------------------


def _int_dict(keys: list[int]) -> str:
    return json.dumps({"dict": [["w", {"tensor": "w"}], ["d", {"dict": [[k, 0] for k in keys]}]]})


def test_int_keys_that_all_hash_alike_are_rejected_fast(tmp_path: Path) -> None:
    keys = [k * (2**61 - 1) for k in range(1, 100_001)]  # all hash to 0: a dict of them is quadratic
    assert len({hash(k) for k in keys}) == 1
    path = craft_checkpoint(tmp_path / "h.safetensors", [("w", "U8", [1], b"x")], _int_dict(keys))
    for call in (ckptstream.load, ckptstream.verify, ckptstream.open):
        start = time.perf_counter()
        with pytest.raises(CorruptCheckpointError, match=r"the dict at d has more than 8 int keys with one hash"):
            call(path)
        assert time.perf_counter() - start < 1.0


def test_int_keys_of_real_states_load(tmp_path: Path) -> None:
    # with 0 (in the range), SAME_HASH keys of hash 0: the most a dict may hold; hash(-1) == hash(-2)
    colliding = [k * (2**61 - 1) for k in range(1, _structure.SAME_HASH)] + [-1, -2]
    keys = [*range(100_000), 2**70, -(2**70), *colliding]
    path = craft_checkpoint(tmp_path / "ok.safetensors", [("w", "U8", [1], b"x")], _int_dict(keys))
    assert list(ckptstream.load(path)["d"]) == keys


# --- linear time ----------------------------------------------------------------------------


def _empty_containers(n: int) -> tuple[list[tuple[str, str, list[int], bytes]], str]:
    return [], '{"list":[' + ",".join(['{"list":[]}', '{"dict":[]}', '{"tuple":[]}'] * (n // 3)) + "]}"


def _one_byte_tensors(n: int) -> tuple[list[tuple[str, str, list[int], bytes]], str]:
    tensors = [(f"t{i}", "U8", [1], bytes([i % 251])) for i in range(n)]
    return tensors, '{"dict":[' + ",".join(f'["t{i}",{{"tensor":"t{i}"}}]' for i in range(n)) + "]}"


def _time_ratio(slow: Path, fast: Path, runs: int = 4) -> float:
    """How many times the CPU time of loading `fast` loading `slow` takes: CPU time of all threads
    (a busy machine stretches wall time), the best of `runs` for each, taken in turns after a
    collection, so that a stall or a collection of the test's own garbage hits neither side alone.
    One untimed load of each first: the first loads of a process pay for its allocator's growth."""
    best = {slow: float("inf"), fast: float("inf")}
    for path in best:
        ckptstream.load(path)
    for _ in range(runs):
        for path in best:
            gc.collect()
            start = time.process_time()
            ckptstream.load(path)
            best[path] = min(best[path], time.process_time() - start)
    return best[slow] / best[fast]


@pytest.mark.parametrize(("make", "n"), [(_empty_containers, 45_000), (_one_byte_tensors, 8_000)],
                         ids=["empty_containers", "one_byte_tensors"])
def test_parsing_time_is_linear_in_the_header_size(make: Callable[[int], Any], n: int, tmp_path: Path) -> None:
    small = craft_checkpoint(tmp_path / "small.safetensors", *make(n))
    large = craft_checkpoint(tmp_path / "large.safetensors", *make(4 * n))
    assert 3.5 < header_size(large) / header_size(small) < 4.5
    ratio = _time_ratio(large, small)
    assert ratio < 8, f"4x the header took {ratio:.1f}x the time"


def test_depth_is_bounded_and_costs_little_within_the_bound(tmp_path: Path) -> None:
    """A node's key path costs its depth, so depth is bounded (MAX_DEPTH, as save enforces):
    leaves at the deepest level allowed cost a small multiple of the same leaves near the top,
    and a structure one level deeper is refused before it costs anything."""
    from ckptstream._format.structure import MAX_DEPTH

    leaves = ",".join(["1"] * 60_000)
    flat = craft_checkpoint(tmp_path / "flat.safetensors", [], '{"list":[{"list":[' + leaves + "]}]}")
    deep = craft_checkpoint(tmp_path / "deep.safetensors", [], '{"list":[' * MAX_DEPTH + leaves + "]}" * MAX_DEPTH)
    ratio = _time_ratio(deep, flat)
    assert ratio < 4, f"the same leaves {MAX_DEPTH} levels deep took {ratio:.1f}x the time"
    deeper = craft_checkpoint(tmp_path / "deeper.safetensors", [], '{"list":[' * 300 + leaves + "]}" * 300)
    with pytest.raises(ckptstream.CorruptCheckpointError, match=f"more than {MAX_DEPTH} deep"):
        ckptstream.load(deeper)
    state: Any = 1
    for _ in range(MAX_DEPTH + 1):
        state = [state]
    with pytest.raises(ckptstream.UnsupportedTypeError, match=f"more than {MAX_DEPTH} deep"):
        ckptstream.save(state, tmp_path / "too-deep.safetensors")
    state = 1
    for _ in range(MAX_DEPTH):
        state = [state]
    ckptstream.save(state, tmp_path / "deepest.safetensors")
    assert ckptstream.load(tmp_path / "deepest.safetensors") == state


# --- memory: a small multiple of the header -------------------------------------------------

_CHILD = textwrap.dedent("""
    import gc, sys
    import ckptstream
    from ckptstream.bench.measure import PeakRss

    path, warm = sys.argv[1], sys.argv[2]
    ckptstream.load(warm)  # imports and first-use allocations out of the measurement
    gc.collect()
    with PeakRss() as peak:
        ckptstream.load(path)
    print(peak.growth)
""")

MULTIPLE = 40  # the documented bound (docs/reliability.md, "Hostile files")


@pytest.mark.parametrize(("make", "n"), [(_empty_containers, 300_000), (_one_byte_tensors, 40_000)],
                         ids=["empty_containers", "one_byte_tensors"])
def test_peak_memory_is_a_small_multiple_of_the_header(make: Callable[[int], Any], n: int, tmp_path: Path) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    path = craft_checkpoint(tmp_path / "big.safetensors", *make(n))
    warm = tmp_path / "warm.safetensors"
    ckptstream.save({"a": {"b": torch.randn(3)}, "c": [1, (2,)]}, warm)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(warm)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    growth, size = int(proc.stdout), header_size(path)
    assert size > 3 * MiB  # big enough that the process's own noise does not count
    assert growth <= MULTIPLE * size, f"peak RSS grew {growth / size:.1f}x the {size}-byte header"
