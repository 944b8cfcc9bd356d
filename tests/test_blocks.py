"""Whole loads put runs of small tensors into shared allocations and read each run as one piece,
while every tensor keeps a checksum of its own: values, the checks, and what the tensors look
like to the caller."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._checkpoint import blocks
from ckptstream._format import header
from tests.helpers import DTYPES, assert_bytes_equal, header_of, random_tensor

_SAVABLE = [d for d in DTYPES if d in header.DTYPE_NAMES]

# small tensors of every dtype and odd sizes, then large ones (own allocations), then small again
_SHAPES = [(1,), (3,), (7, 5), (13,), (4097,), (2, 3, 5), (), (257,)]


def _mixed_state(device: torch.device | str, large: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    state = {}
    for i in range(60):
        dtype = _SAVABLE[i % len(_SAVABLE)]
        state[f"small.{i}"] = random_tensor(_SHAPES[i % len(_SHAPES)], dtype, device)
    for i in range(large):
        state[f"large.{i}"] = random_tensor((blocks.shared_below_on(torch.device(device)) // 4 + 3,), torch.float32,
                                            device)
    for i in range(20):
        state[f"tail.{i}"] = random_tensor((i + 1,), torch.bfloat16 if i % 2 else torch.int64, device)
    return state


@pytest.mark.parametrize("buffer_size", [4096, 3 * 4096, 16 << 20], ids=["4k", "12k", "16m"])
def test_a_load_returns_every_tensor_exactly(device: torch.device, buffer_size: int, tmp_path: Path) -> None:
    state = _mixed_state(device)
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    loaded = ckptstream.load(path, device=device,
                             settings=Settings(buffer_size=buffer_size))  # chunks cut runs and elements
    assert list(loaded) == list(state)
    for key, t in state.items():
        assert (loaded[key].dtype, loaded[key].shape, loaded[key].device) == (t.dtype, t.shape, t.device)
        assert loaded[key].is_contiguous()
        assert_bytes_equal(loaded[key], t)


def test_small_tensors_share_allocations_and_large_ones_own_theirs(device: torch.device, tmp_path: Path) -> None:
    torch.manual_seed(5)
    state = {f"s{i:03d}": random_tensor((i % 7 + 1,), torch.int64 if i % 2 else torch.float32, device)
             for i in range(300)}
    state["large"] = random_tensor((blocks.shared_below_on(device) // 4 + 1,), torch.float32, device)
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    start, table = header_of(path)
    loaded = ckptstream.load(path, device=device)
    for dtype in (torch.int64, torch.float32):  # each run of small tensors: one allocation, file positions kept
        run = sorted((table[k]["data_offsets"][0], t.data_ptr()) for k, t in loaded.items()
                     if k != "large" and t.dtype == dtype)
        assert all(ptr - run[0][1] == offset - run[0][0] for offset, ptr in run)
    t = loaded["large"]
    assert (t.untyped_storage().nbytes(), t.storage_offset()) == (t.nbytes, 0)  # freed when dropped
    if device.type == "cpu":  # host tensors own a storage over their bytes, as torch.load's do
        assert all(t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes for t in loaded.values())
    reader = ckptstream.open(path)
    assert len(blocks.arrange(reader.header.tensors, start, device).pieces) == 3
    reader.close()


def test_host_tensors_work_where_torch_assumes_storage_offset_0(tmp_path: Path) -> None:
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    expected = torch.randn(4)
    state = {"bias": random_tensor((3,), torch.float16), "rng": rng, "w": random_tensor((9,))}
    ckptstream.save(state, tmp_path / "c.safetensors")
    loaded = ckptstream.load(tmp_path / "c.safetensors")
    torch.set_rng_state(loaded["rng"])  # reads the storage from its start
    assert torch.equal(torch.randn(4), expected)


def test_a_corrupt_byte_names_its_own_tensor_not_its_neighbours(device: torch.device, tmp_path: Path) -> None:
    state = _mixed_state(device, large=1)
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    start, table = header_of(path)
    for key in ("small.9", "tail.3", "large.0"):
        begin, end = table[key]["data_offsets"]
        data = bytearray(path.read_bytes())
        data[start + (begin + end) // 2] ^= 0x10
        bad = tmp_path / f"bad-{key}.safetensors"
        bad.write_bytes(bytes(data))
        for buffer_size in (4096, 16 << 20):
            with pytest.raises(ckptstream.CorruptCheckpointError, match=rf"'{key}' fails its CRC-32C"):
                ckptstream.load(bad, device=device, settings=Settings(buffer_size=buffer_size))


def test_unaligned_tensors_of_a_foreign_file_load_alone(device: torch.device, tmp_path: Path) -> None:
    # a hand-made safetensors file whose float32 and int64 tensors start at odd offsets
    a, b, c = random_tensor((3,), torch.uint8), random_tensor((5,), torch.float32), random_tensor((2,), torch.int64)
    blobs = [("a", "U8", a), ("b", "F32", b), ("c", "I64", c)]
    table, pos = {}, 0
    for name, dtype, t in blobs:
        table[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    body = str(table).replace("'", '"').encode()
    body += b" " * (-len(body) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"".join(t.numpy().tobytes() for *_, t in blobs))
    expected = safetensors.torch.load_file(path)
    loaded = ckptstream.load(path, device=device)
    for name, _, t in blobs:
        assert_bytes_equal(loaded[name], t)
        assert_bytes_equal(loaded[name], expected[name])
        assert loaded[name].data_ptr() % t.element_size() == 0


def test_tensors_outlive_the_reader_and_each_other(device: torch.device, tmp_path: Path) -> None:
    state = _mixed_state(device)
    ckptstream.save(state, tmp_path / "c.safetensors")
    keep = ckptstream.load(tmp_path / "c.safetensors", device=device)["small.5"].clone()
    one = ckptstream.load(tmp_path / "c.safetensors", device=device)["small.5"]  # the rest is dropped
    torch.empty(4 << 20, dtype=torch.uint8, device=device).fill_(0xAB)  # reuse freed memory, if any
    assert_bytes_equal(one, keep)
    one.fill_(1)  # writable
    assert bool((one == 1).all())


def test_host_tensors_of_a_few_mib_share_allocations(tmp_path: Path) -> None:
    """In host memory tensors share up to BLOCK: fresh small allocations fault page by page."""
    torch.manual_seed(11)
    sizes = [3 << 20, 1 << 20, (5 << 20) + 12, 2 << 20]
    state = {f"w{i}": random_tensor((n // 4,), torch.float32) for i, n in enumerate(sizes)}
    path = tmp_path / "c.safetensors"
    ckptstream.save(state, path)
    start, table = header_of(path)
    loaded = ckptstream.load(path)
    run = sorted((table[k]["data_offsets"][0], t.data_ptr()) for k, t in loaded.items())
    assert all(ptr - run[0][1] == offset - run[0][0] for offset, ptr in run)  # one allocation, file positions kept
    for key, t in state.items():
        assert_bytes_equal(loaded[key], t)
    reader = ckptstream.open(path)
    assert len(blocks.arrange(reader.header.tensors, start, torch.device("cpu")).pieces) == 1
    assert len(blocks.arrange(reader.header.tensors, start, torch.device("meta")).pieces) == 4  # a device: alone
    reader.close()
