"""CRC-32C of CUDA memory, computed on the GPU (a Triton kernel), for loads that verify.

A hot load is bound by host memory traffic: the page cache is read, the staging buffer written,
then read by the device copy. Checksumming the staging buffer on the host reads it once more,
which cost hot loads 12-20% on the H200 machine, however fast the CRC code (see
docs/benchmarks.md). The GPU reads device memory at terabytes a second and idles during a load,
so a load into CUDA tensors checksums the large contiguous ones there, once all copies are
queued: one launch per device for all of them, on the copies' stream. Small tensors stay on the
host, as does everything where Triton is missing or its self-test fails.

The kernel: each program takes one block of BLOCK bytes of one tensor (a tensor is padded with
zeros in front to whole blocks: leading zeros leave a CRC register of 0 unchanged). Each of its
LANES lanes runs the CRC register over 64 bytes with slicing-by-4 tables; each lane's value is
moved to the end of the block (multiplied by x^(8 * bytes after it) mod P), the lanes XOR-ed,
the block's value moved to the end of the tensor likewise and XOR-ed into the tensor's slot with
an atomic. That is the tensor's register from 0 without inversions; ``finish`` makes it a CRC-32C.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings

import torch

from . import _checksum

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without it
    triton = None  # type: ignore[assignment]

GPU_FROM = 1 << 20  # tensors from this size are checksummed on the GPU
LANES, LANE_BYTES = 256, 256
BLOCK = LANES * LANE_BYTES
_SHIFTS = 4096  # blocks after a block: up to _SHIFTS**2 (1 TiB tensors), looked up in two steps
GPU_UP_TO = BLOCK * _SHIFTS**2


def _tables() -> list[int]:
    """Slicing-by-4 tables for the reflected CRC-32C register: t[k * 256 + v] is byte v followed
    by k zero bytes."""
    t0 = []
    for v in range(256):
        for _ in range(8):
            v = (v >> 1) ^ _checksum._POLY if v & 1 else v >> 1
        t0.append(v)
    tables = list(t0)
    for k in range(1, 4):
        tables += [t0[c & 0xFF] ^ (c >> 8) for c in tables[(k - 1) * 256 : k * 256]]
    return tables


def _powers(nbytes: int, count: int) -> list[int]:
    """x^(8 * nbytes * k) mod P for k < count."""
    step, out = _checksum._x8nmodp(nbytes), [1 << 31]
    while len(out) < count:
        out.append(_checksum._multmodp(out[-1], step))
    return out


def _constants() -> list[int]:
    """The slicing tables; x^(8 * LANE_BYTES * (LANES-1-lane)) per lane; x^(8 * BLOCK * k) and
    x^(8 * BLOCK * _SHIFTS * k) for k < _SHIFTS."""
    lanes = _powers(LANE_BYTES, LANES)[::-1]
    return _tables() + lanes + _powers(BLOCK, _SHIFTS) + _powers(BLOCK * _SHIFTS, _SHIFTS)


if triton is not None:

    @triton.jit
    def _xor(a, b):  # type: ignore[no-untyped-def]
        return a ^ b

    @triton.jit
    def _mulmod(a, b):  # type: ignore[no-untyped-def]
        """a * b mod P, reflected (bit 31 holds x^0), element-wise on uint32."""
        poly = tl.full([], 0x82F63B78, tl.uint32)
        p = a ^ a
        for i in tl.static_range(32):
            p = p ^ (b * ((a >> (31 - i)) & 1))
            b = (b >> 1) ^ ((b & 1) * poly)
        return p

    @triton.jit
    def _table(consts, index):  # type: ignore[no-untyped-def]
        return tl.load(consts + index).to(tl.uint32, bitcast=True)

    @triton.jit
    def _crc_kernel(tensors, block_tensors, consts, out,  # type: ignore[no-untyped-def]
                    LANES: tl.constexpr, LANE_BYTES: tl.constexpr, SHIFTS: tl.constexpr):
        pid = tl.program_id(0)
        tensor = tl.load(block_tensors + pid)
        words = tl.load(tensors + 3 * tensor).to(tl.pointer_type(tl.uint32))  # 4-byte aligned
        n = tl.load(tensors + 3 * tensor + 1)  # a multiple of 4
        block = pid - tl.load(tensors + 3 * tensor + 2)  # minus the tensor's first block
        blocks = (n + LANES * LANE_BYTES - 1) // (LANES * LANE_BYTES)
        lane = tl.arange(0, LANES)
        # word offsets: the padding in front of the first block is negative (a multiple of 4)
        start = ((block - blocks) * (LANES * LANE_BYTES) + n) // 4 + lane.to(tl.int64) * (LANE_BYTES // 4)
        crc = tl.zeros([LANES], dtype=tl.uint32)
        for j in range(LANE_BYTES // 4):  # a loop, not unrolled: unrolled, it compiled for minutes
            x = crc ^ tl.load(words + start + j, mask=start + j >= 0, other=0)
            crc = (_table(consts, 768 + (x & 0xFF)) ^ _table(consts, 512 + ((x >> 8) & 0xFF))
                   ^ _table(consts, 256 + ((x >> 16) & 0xFF)) ^ _table(consts, x >> 24))
        value = tl.reduce(_mulmod(crc, _table(consts, 1024 + lane)), 0, _xor)
        after = blocks - 1 - block  # whole blocks after this one: x^(8 * BLOCK * after)
        shifts = 1024 + LANES
        value = _mulmod(value, _table(consts, shifts + after % SHIFTS))
        value = _mulmod(value, _table(consts, shifts + SHIFTS + after // SHIFTS))
        tl.atomic_xor(out + tensor, value.to(tl.int32, bitcast=True))


_consts: dict[torch.device, torch.Tensor] = {}
_usable: dict[torch.device, bool] = {}
_lock = threading.Lock()


def crcs(tensors: list[torch.Tensor]) -> list[int]:
    """The CRC-32C of each of ``tensors`` (uint8, 1-d, contiguous, on one CUDA device; see
    ``eligible``), in one launch on the device's current stream; waits for it."""
    device = tensors[0].device
    lengths = [t.numel() for t in tensors]
    blocks = [-(-n // BLOCK) for n in lengths]
    firsts = list(itertools.accumulate(blocks, initial=0))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # CPU: Triton's interpreter
        if device not in _consts:  # int32 wraps the large ones: the kernel reads their bits
            _consts[device] = torch.tensor(_constants(), dtype=torch.int64).to(torch.int32).to(device)
        # one table, so that the kernel is compiled once (Triton specializes on pointer alignment)
        table = torch.tensor([[t.data_ptr(), n, first] for t, n, first in zip(tensors, lengths, firsts[:-1], strict=True)],
                             dtype=torch.int64).to(device)
        block_tensors = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32, device=device),
                                                table.new_tensor(blocks), output_size=firsts[-1])
        out = torch.zeros(len(tensors), dtype=torch.int32, device=device)
        _crc_kernel[(firsts[-1],)](table, block_tensors, _consts[device], out,
                                   LANES=LANES, LANE_BYTES=LANE_BYTES, SHIFTS=_SHIFTS)
        return [finish(r, n) for r, n in zip(out.tolist(), lengths, strict=True)]


def eligible(t: torch.Tensor) -> bool:
    """Whether ``crcs`` takes the bytes ``t`` (uint8, 1-d, contiguous): it reads whole aligned
    32-bit words."""
    return GPU_FROM <= t.numel() < GPU_UP_TO and t.numel() % 4 == 0 and t.data_ptr() % 4 == 0


def finish(register: int, nbytes: int) -> int:
    """The CRC-32C of ``nbytes`` bytes whose register from 0 (no inversions) is ``register``:
    the register is linear in the bytes, so add what the initial all-ones contribute."""
    return (register & 0xFFFFFFFF) ^ _checksum._multmodp(_checksum._x8nmodp(nbytes), 0xFFFFFFFF) ^ 0xFFFFFFFF


def usable(device: torch.device) -> bool:
    """Whether the kernel runs and agrees with the host's CRC on ``device``, tried once per
    device and process (the first try compiles it; Triton caches that on disk)."""
    if triton is None or device.type != "cuda":
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if device not in _usable:
            _usable[device] = _self_test(device)
        return _usable[device]


def _self_test(device: torch.device) -> bool:
    try:
        data = torch.randint(0, 256, (3 * BLOCK + 12344,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        pieces = [data[8:], data[:4], data[4 : BLOCK + 8]]  # whole 32-bit words, as ``eligible`` admits
        if crcs([p.to(device) for p in pieces]) == [_checksum.crc_of(p.numpy().tobytes()) for p in pieces]:
            return True
        warnings.warn(f"ckptstream: the GPU checksum disagrees with the host's on {device}: "
                      "checksumming on the host instead", RuntimeWarning, stacklevel=3)
    except Exception as e:  # any failure to compile or run: use the host
        warnings.warn(f"ckptstream: the GPU checksum failed on {device} ({type(e).__name__}: {e}): "
                      "checksumming on the host instead", RuntimeWarning, stacklevel=3)
    return False
