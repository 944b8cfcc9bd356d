"""device_to_file / file_to_device round trips: every dtype and layout, odd sizes and buffer
sizes that cut elements, many chunks through few buffers, I/O threads finishing out of order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream import DirectIO, Settings
from tests.helpers import (
    EDGE_CASE_NAMES,
    EDGE_CASES,
    EdgeCase,
    MiB,
    as_bytes,
    assert_bytes_equal,
    buffers,
    nbytes,
    poisoned_like,
    random_bytes,
    random_tensor,
)

SEED_MATRIX = [(1025, 10000, 10000), (1025, 1024, 513), (500, 2000, 2000), (125000, 10000, 10000)]


@pytest.mark.parametrize("num_buffers", [1, 2])
@pytest.mark.parametrize(("n", "write_size", "read_size"), SEED_MATRIX)
def test_seed_matrix(device: torch.device, tmp_path: Path, n: int, write_size: int, read_size: int,
                     num_buffers: int) -> None:
    src = random_tensor(n, torch.float32, device)
    path = tmp_path / "t.bin"
    assert ckptstream.device_to_file(src, path, settings=Settings(buffer_size=write_size,
                                                                  num_buffers=num_buffers)) == 4 * n
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, settings=Settings(buffer_size=read_size,
                                                                  num_buffers=num_buffers)) == 4 * n
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize(("write_size", "read_size"), [(13, 7), (4096, 4099), (None, None)],
                         ids=["tiny", "page", "default"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=EDGE_CASE_NAMES)
def test_edge_case_round_trip(device: torch.device, tmp_path: Path, case: EdgeCase, write_size: int | None,
                              read_size: int | None) -> None:
    """Every dtype and layout: the file holds the logical row-major bytes (src.contiguous()),
    and a read fills the same kind of view without touching the storage around it."""
    src = case.source(device)
    path = tmp_path / "t.bin"
    assert ckptstream.device_to_file(src, path, settings=buffers(write_size)) == nbytes(src)
    assert path.read_bytes() == as_bytes(src)
    if case.writable:
        base, dst = case.destination(device)
    else:  # an expanded view cannot be a destination: read its bytes into a plain tensor
        base = dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, settings=buffers(read_size)) == nbytes(src)
    assert_bytes_equal(dst, src)
    if case.writable:
        assert_bytes_equal(base, case.expected_base(src))


def test_zero_bytes(device: torch.device, tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"old contents")
    empty = torch.empty(0, 5, device=device)
    assert ckptstream.device_to_file(empty, path) == 0
    assert path.read_bytes() == b""  # a path with offset=None is truncated
    assert ckptstream.file_to_device(path, torch.empty(0, device=device)) == 0
    with open(path, "r+b") as f:
        f.write(b"abc")
        assert ckptstream.device_to_file(empty, f) == 0
        assert f.tell() == 3
        assert ckptstream.file_to_device(f, empty, offset=3) == 0
    assert path.read_bytes() == b"abc"


def test_one_byte(device: torch.device, tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    src = random_bytes(1, device)
    assert ckptstream.device_to_file(src, path, settings=Settings(buffer_size=1, num_buffers=1)) == 1
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, settings=Settings(buffer_size=1)) == 1
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize("size", [3, 4095, 4097, 12289, 65537])
@pytest.mark.parametrize("buffer_size", [4096, 8192, 1000, 4097])
def test_odd_sizes(device: torch.device, tmp_path: Path, direct_io: DirectIO, size: int, buffer_size: int) -> None:
    src = random_bytes(size, device)
    path = tmp_path / "t.bin"
    if direct_io is DirectIO.ON and buffer_size % 4096:
        with pytest.raises(ValueError, match="multiple of 4096"):
            ckptstream.device_to_file(src, path, settings=Settings(buffer_size=buffer_size, direct_io=direct_io))
        return
    assert ckptstream.device_to_file(src, path, settings=Settings(buffer_size=buffer_size, num_buffers=3,
                                                                  direct_io=direct_io)) == size
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    assert ckptstream.file_to_device(path, dst, settings=Settings(buffer_size=buffer_size, num_buffers=2,
                                                                  direct_io=direct_io)) == size
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize("buffer_size", [1, 3, 1000, 4095, 4097, 10000, 12289])
def test_buffer_sizes_not_multiples_of_4096(device: torch.device, tmp_path: Path, buffer_size: int) -> None:
    src = random_tensor(1001 if buffer_size < 1000 else 30001, torch.float16, device)  # odd element counts
    path = tmp_path / "t.bin"
    assert ckptstream.device_to_file(src, path, settings=buffers(buffer_size)) == nbytes(src)
    assert path.read_bytes() == as_bytes(src)
    dst = poisoned_like(src)
    ckptstream.file_to_device(path, dst, settings=Settings(buffer_size=buffer_size + 2))
    assert_bytes_equal(dst, src)


def test_parameter_round_trip(device: torch.device, tmp_path: Path) -> None:
    """Leaves that require grad are read and written in place, without autograd errors."""
    p = torch.nn.Parameter(random_tensor((17, 3), torch.float32, device))
    path = tmp_path / "p.bin"
    ckptstream.device_to_file(p, path, settings=Settings(buffer_size=20))
    q = torch.nn.Parameter(poisoned_like(p.detach()))
    ckptstream.file_to_device(path, q, settings=Settings(buffer_size=28))
    assert_bytes_equal(q.detach(), p.detach())
    assert q.requires_grad
    assert q.grad_fn is None


# --- the reuse race: many chunks through few buffers ---------------------------------------------


@pytest.mark.parametrize(("buffer_size", "num_buffers", "io_threads"), [(4096, 2, 2), (8192, 3, 3), (4096, 3, 2)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_many_chunks_through_few_buffers(device: torch.device, tmp_path: Path, buffer_size: int,
                                         num_buffers: int, io_threads: int, layout: str) -> None:
    """4 MiB through 2-3 small buffers and several I/O threads: a buffer refilled before its
    write (or its host-to-device copy) finished would show as corrupt bytes. (A contiguous host
    destination is read straight into; a transposed one goes through the staging buffers.)"""
    base = random_tensor((1024, 1024), torch.float32, device)
    src = base if layout == "contiguous" else base.t()
    path = tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=buffer_size, num_buffers=num_buffers, io_threads=io_threads,
                             direct_io="off"):
        for _ in range(2):
            assert ckptstream.device_to_file(src, path) == 4 * MiB
            assert path.read_bytes() == as_bytes(src)
            dst = poisoned_like(base) if layout == "contiguous" else poisoned_like(base).t()
            assert ckptstream.file_to_device(path, dst) == 4 * MiB
            assert_bytes_equal(dst, src)


@pytest.mark.usefixtures("jitter")
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_out_of_order_io_threads(device: torch.device, tmp_path: Path, direct_io: DirectIO, layout: str) -> None:
    """I/O threads finishing in random order must not reorder or mix chunks."""
    base = random_tensor((256, 257), torch.float32, device)
    src = base if layout == "contiguous" else base.t()
    path = tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=4096, num_buffers=3, io_threads=3):
        ckptstream.device_to_file(src, path, offset=4099 if direct_io is DirectIO.ON else None)
        data = path.read_bytes()
        assert data[-nbytes(src):] == as_bytes(src)
        dst = poisoned_like(base).t() if layout == "transposed" else poisoned_like(base)
        ckptstream.file_to_device(path, dst, offset=len(data) - nbytes(src))
    assert_bytes_equal(dst, src)
