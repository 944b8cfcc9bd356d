"""Edges of the engines that ordinary sizes never reach: a write that the OS accepts with 0 bytes
written, and loads into non-contiguous tensors whose chunks cut an element in two (its first
bytes wait in a carry until the next chunk completes it)."""

from __future__ import annotations

import errno
import itertools
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._engine import tensor_bytes
from tests.helpers import assert_bytes_equal, poison, random_tensor

# --- a write of 0 bytes -----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["header", "data", "checksums"])
def test_a_write_of_0_bytes_is_an_eio_naming_the_file_not_a_short_file(which: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """os.pwrite returning 0 (no error, nothing written: a full quota on some file systems) for
    the header, a chunk of data, or the header's rewrite with the checksums: the save raises
    OSError(EIO) naming the file and the offset, and the old checkpoint stays whole."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"old": torch.arange(7)}, path)
    old = path.read_bytes()
    state = {"w": random_tensor(30_000), "b": random_tensor(5)}
    opts: dict[str, Any] = {"buffer_size": 16 << 10, "num_buffers": 2, "io_threads": 1, "direct_io": "off"}
    calls, real = [], os.pwrite
    # header at 0, then each chunk of data, then the header again
    zero_at = {"header": 0, "data": 3, "checksums": -1}[which]
    expected_offset = {"header": "0", "data": r"\d+", "checksums": "0"}[which]

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(offset)
        index = len(calls) - 1
        rewrite = which == "checksums" and offset == 0 and index > 0
        if index == zero_at or rewrite:
            return 0
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match=rf"write returned 0 at offset {expected_offset}") as e:
        ckptstream.save(state, path, settings=Settings(**opts))
    monkeypatch.undo()
    assert e.value.errno == errno.EIO
    assert ".ckpt.safetensors.ckptstream-tmp-" in str(e.value.filename)
    if which == "data":
        assert calls[3] > 0  # a chunk of the data, not the header
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_a_write_of_0_bytes_through_device_to_file_is_an_eio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "t.bin"
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError, match="write returned 0 at offset 4096") as e:
        ckptstream.device_to_file(random_tensor(100), target, offset=4096)
    assert e.value.errno == errno.EIO
    assert e.value.filename == str(target)


# --- an element cut by a chunk's edge ----------------------------------------------------------


def transposed_poisoned(shape: tuple[int, int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A non-contiguous destination of ``shape`` (a transpose), poisoned."""
    return poison(torch.empty(shape[1], shape[0], dtype=dtype, device=device)).t()


@pytest.mark.parametrize("io_threads", [1, 3])
@pytest.mark.parametrize("buffer_size", [4099, 6151])  # odd: every dtype's elements are cut
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.complex64, torch.float32], ids=str)
def test_non_contiguous_loads_whose_chunks_cut_elements(device: torch.device, dtype: torch.dtype, buffer_size: int,
                                                        io_threads: int, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffer sizes that are no multiple of the element size: chunk edges fall inside elements
    of the tensors, which read_into and load_into fill through a carry, in file order across the
    I/O threads."""
    w, v = random_tensor((160, 33), dtype), random_tensor((9, 70), dtype)
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"w": w, "v": v}, path)
    cuts: list[tuple[int, int]] = []
    real = tensor_bytes.copy_in

    def spy(src: torch.Tensor, t: torch.Tensor, lo: int, hi: int, carry: torch.Tensor | None) -> None:
        if lo % t.element_size():
            cuts.append((lo, hi))
        real(src, t, lo, hi, carry)

    monkeypatch.setattr("ckptstream._engine.read.copy_in", spy)
    opts: dict[str, Any] = {"buffer_size": buffer_size, "num_buffers": 2, "io_threads": io_threads}
    dst = transposed_poisoned((160, 33), dtype, device)
    with ckptstream.open(path, settings=Settings(**opts)) as reader:
        reader.read_into("w", dst)
    assert_bytes_equal(dst, w)
    assert cuts, "no chunk began inside an element: the test proves nothing"
    state = {"w": transposed_poisoned((160, 33), dtype, device), "v": transposed_poisoned((9, 70), dtype, device)}
    ckptstream.load_into(state, path, settings=Settings(**opts))
    assert_bytes_equal(state["w"], w)
    assert_bytes_equal(state["v"], v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32], ids=str)
def test_copy_in_completes_cut_elements_wherever_the_staged_bytes_lie(dtype: torch.dtype) -> None:
    """``copy_in`` of a non-contiguous tensor's bytes in pieces cut at random bytes, each piece
    staged at a random offset of a buffer: where the staged bytes align with the elements they
    are copied as elements in place (the element cut at the piece's start completed from the
    carry first), elsewhere through a temporary. The engine's planner starts a chunk inside an
    element only where its staging offset does not align, so only this test reaches the first
    way with a cut element."""
    rng = random.Random(21)
    t = random_tensor((23, 17), dtype)
    esz, total = t.element_size(), t.nbytes
    src = t.contiguous().view(-1).view(torch.uint8)
    ways: set[tuple[bool, bool]] = set()
    for _ in range(40):
        dst = transposed_poisoned((23, 17), dtype, "cpu")
        carry = torch.empty(esz, dtype=torch.uint8)
        cuts = sorted(rng.sample(range(1, total), 12))
        for lo, hi in itertools.pairwise([0, *cuts, total]):
            head = -lo % esz
            at = rng.choice([(-head) % esz, rng.randrange(esz)])  # aligned with the elements, or not
            staging = torch.empty(at + hi - lo + 8, dtype=torch.uint8)
            staging[at : at + hi - lo] = src[lo:hi]
            ways.add((head > 0, tensor_bytes._in_place(dst, staging[at : at + hi - lo], lo, hi) is not None))
            tensor_bytes.copy_in(staging[at : at + hi - lo], dst, lo, hi, carry)
        assert_bytes_equal(dst, t)
    assert ways == {(False, False), (False, True), (True, False), (True, True)}
