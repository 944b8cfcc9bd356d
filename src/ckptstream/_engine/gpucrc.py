"""CRC-32C of CUDA memory, computed on the GPU, for loads that verify.

A hot load is bound by host memory traffic: the page cache is read, the staging buffer written,
then read by the device copy. Checksumming the staging buffer on the host reads it once more,
however fast the CRC code. The GPU reads device memory far faster and idles during a load, so a
load into CUDA tensors checksums the large contiguous ones there, once all copies are queued:
one launch per device for all of them, on the copies' stream. A whole load of many small tensors
(runs of them in one allocation, see ``_checkpoint.blocks``) checksums each tensor there too, with a second
instance of the kernel whose blocks are one warp and 1 KiB, so that 20,000 tensors cost one
launch and a few vectorised steps instead of a host call each. Everything stays on the host where the
kernel cannot be built or its self-test fails.

The kernel is CUDA C, compiled for the device on first use by NVRTC, the runtime compiler that
CUDA builds of torch ship with (no CUDA toolkit needed), and launched through torch's loader
for such kernels.

Each thread block takes BLOCK bytes of one tensor (a tensor is padded with zeros in front to
whole blocks: leading zeros leave a CRC register of 0 unchanged). Its LANES threads read the
block's 32-bit words interleaved, thread l words l, l + LANES, ..., so that each step reads
LANES consecutive words. A thread keeps R = R * x^(32 * LANES) + word (mod P, the multiplication
by lookups in tables in shared memory, a byte at a time); at the end R * x^(32 * (LANES - l)) is
its share of the block's CRC register. The shares are XOR-ed, the block's value moved to the end
of the tensor (multiplied by x^(8 * bytes after it)) and XOR-ed into the tensor's slot with an
atomic. That is the tensor's register from 0 without inversions; ``finish`` makes it a CRC-32C.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .. import _checksum

GPU_FROM = 1 << 20  # tensors from this size are checksummed on the GPU
LANES, WORDS = 256, 256  # a block: LANES threads x WORDS 32-bit words
BLOCK = LANES * WORDS * 4
SPAN_LANES, SPAN_WORDS = 32, 8  # the instance for spans of small tensors: a warp per KiB
SPAN_BLOCK = SPAN_LANES * SPAN_WORDS * 4
_SHIFTS = 4096  # blocks after a block: up to _SHIFTS**2 (4 TiB tensors), looked up in two steps
GPU_UP_TO = BLOCK * _SHIFTS**2
SPAN_UP_TO = SPAN_BLOCK * _SHIFTS**2

_SOURCE = r"""
__device__ unsigned int mulmod(unsigned int a, unsigned int b) {  // a * b mod P, reflected
    unsigned int p = 0;
    for (int i = 0; i < 32; i++) {
        p ^= b * ((a >> (31 - i)) & 1);
        b = (b >> 1) ^ ((b & 1) * 0x82F63B78u);
    }
    return p;
}

// tensors: [count, 3] (address, bytes, first block); consts: see _constants(); out: registers
template <int LANES, int WORDS>
__device__ void crc32c_blocks(const long long* tensors, int count, const unsigned int* consts, unsigned int* out) {
    __shared__ unsigned int table[1024];
    __shared__ unsigned int shares[LANES / 32];
    for (int i = threadIdx.x; i < 1024; i += LANES) table[i] = consts[i];
    int lo = 0, hi = count - 1;  // the tensor of this block: the last one starting at or before it
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tensors[3 * mid + 2] <= blockIdx.x) lo = mid; else hi = mid - 1;
    }
    const unsigned int* words = (const unsigned int*)tensors[3 * lo];  // 4-byte aligned
    const long long n = tensors[3 * lo + 1] / 4;  // whole words
    const long long block = blockIdx.x - tensors[3 * lo + 2];
    const long long blocks = (n + LANES * WORDS - 1) / (LANES * WORDS);
    const long long start = (block - blocks) * (LANES * WORDS) + n + threadIdx.x;  // < 0: padding
    __syncthreads();
    unsigned int r = 0;
#pragma unroll 8
    for (int j = 0; j < WORDS; j++) {
        const long long at = start + (long long)j * LANES;
        const unsigned int word = at >= 0 ? __ldg(words + at) : 0u;
        r = table[r & 255] ^ table[256 + ((r >> 8) & 255)] ^ table[512 + ((r >> 16) & 255)]
            ^ table[768 + (r >> 24)] ^ word;
    }
    r = mulmod(r, consts[1024 + threadIdx.x]);
    for (int o = 16; o > 0; o >>= 1) r ^= __shfl_xor_sync(0xffffffffu, r, o);
    if (threadIdx.x % 32 == 0) shares[threadIdx.x / 32] = r;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int value = 0;
        for (int i = 0; i < LANES / 32; i++) value ^= shares[i];
        const long long after = blocks - 1 - block;  // whole blocks after this one
        value = mulmod(value, consts[1024 + LANES + after % SHIFTS]);
        value = mulmod(value, consts[1024 + LANES + SHIFTS + after / SHIFTS]);
        atomicXor(out + lo, value);
    }
}

extern "C" __global__ void __launch_bounds__(TENSOR_LANES) crc32c_tensors(
        const long long* tensors, int count, const unsigned int* consts, unsigned int* out) {
    crc32c_blocks<TENSOR_LANES, TENSOR_WORDS>(tensors, count, consts, out);
}

extern "C" __global__ void __launch_bounds__(SPAN_LANES) crc32c_spans(
        const long long* tensors, int count, const unsigned int* consts, unsigned int* out) {
    crc32c_blocks<SPAN_LANES, SPAN_WORDS>(tensors, count, consts, out);
}
"""


def _times(constant: int) -> list[int]:
    """Tables that multiply a register by ``constant`` mod P a byte at a time: t[k * 256 + v] is
    byte v of the register, at byte k, times the constant."""
    return [_checksum.multiply(v << (8 * k), constant) for k in range(4) for v in range(256)]


def _powers(nbytes: int, count: int) -> list[int]:
    """x^(8 * nbytes * k) mod P for k < count."""
    step, out = _checksum.shift(nbytes), [1 << 31]
    while len(out) < count:
        out.append(_checksum.multiply(out[-1], step))
    return out


def _constants(lanes: int | None = None, block: int | None = None) -> list[int]:
    """For blocks of ``lanes`` threads and ``block`` bytes (default: LANES and BLOCK): tables
    times x^(32 * lanes); x^(32 * (lanes - lane)) per thread; x^(8 * block * k) and
    x^(8 * block * _SHIFTS * k) for k < _SHIFTS."""
    lanes, block = lanes or LANES, block or BLOCK
    return (_times(_checksum.shift(4 * lanes)) + _powers(4, lanes + 1)[:0:-1]
            + _powers(block, _SHIFTS) + _powers(block * _SHIFTS, _SHIFTS))


class _Built(NamedTuple):
    """A device's two instances of the kernel, each with its constants."""

    tensors: tuple[Any, torch.Tensor]  # LANES x WORDS: large tensors
    spans: tuple[Any, torch.Tensor]  # SPAN_LANES x SPAN_WORDS: many small ones


_kernels: dict[torch.device, _Built | None] = {}
_lock = threading.Lock()


Waiter = Callable[[], list[int]]  # waits for a launch and gives its CRC-32Cs


def crcs(tensors: list[torch.Tensor]) -> list[int]:
    """``launch``, waited for."""
    return launch(tensors)()


def launch(tensors: list[torch.Tensor]) -> Waiter:
    """The CRC-32C of each of ``tensors`` (uint8, 1-d, contiguous, on one CUDA device for which
    ``usable`` said yes; see ``eligible``), in one launch on the device's current stream,
    without waiting for it: the function returned waits and gives them."""
    device = tensors[0].device
    kernel, consts = _kernels[device].tensors  # type: ignore[union-attr]
    lengths = [t.numel() for t in tensors]
    firsts = list(itertools.accumulate((-(-n // BLOCK) for n in lengths), initial=0))
    with torch.cuda.device(device):
        rows = [[t.data_ptr(), n, first] for t, n, first in zip(tensors, lengths, firsts[:-1], strict=True)]
        table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
        out = torch.zeros(len(tensors), dtype=torch.int32, device=device)
        kernel(grid=(firsts[-1], 1, 1), block=(LANES, 1, 1), args=[table, len(tensors), consts, out])
        stream = torch.cuda.current_stream(device)

    def wait() -> list[int]:
        with torch.cuda.stream(stream):  # read back after the kernel, from any thread
            return [finish(r, n) for r, n in zip(out.tolist(), lengths, strict=True)]
    return wait


Spans = tuple[torch.Tensor, Sequence[int], Sequence[int]]  # memory, the ranges' begins and ends in it


def span_crcs(memory: torch.Tensor, begins: Sequence[int], ends: Sequence[int]) -> list[int]:
    """``launch_spans`` of the ranges of one tensor, waited for."""
    return launch_spans([(memory, begins, ends)])()


def launch_spans(runs: Sequence[Spans]) -> Waiter:
    """The CRC-32C of each byte range ``begins[k]:ends[k]`` of each run's ``memory`` (uint8, 1-d,
    contiguous, on one CUDA device for which ``usable`` said yes; see ``spans_eligible``), in
    order, in one launch of the spans' instance on the device's current stream, as ``launch``.
    Tables and results are handled as tensors: nothing here costs a Python step per range."""
    device = runs[0][0].device
    kernel, consts = _kernels[device].spans  # type: ignore[union-attr]
    lo = torch.cat([torch.tensor(begins, dtype=torch.int64) for _, begins, _ in runs])
    lengths = torch.cat([torch.tensor(ends, dtype=torch.int64) for _, _, ends in runs]) - lo
    lo += torch.cat([torch.full((len(begins),), memory.data_ptr(), dtype=torch.int64) for memory, begins, _ in runs])
    blocks = (lengths + SPAN_BLOCK - 1) // SPAN_BLOCK
    with torch.cuda.device(device):
        table = _to_device(torch.stack([lo, lengths, blocks.cumsum(0) - blocks], 1), device)
        out = torch.zeros(len(lo), dtype=torch.int32, device=device)
        kernel(grid=(int(blocks.sum()), 1, 1), block=(SPAN_LANES, 1, 1), args=[table, len(lo), consts, out])
        stream = torch.cuda.current_stream(device)

    def wait() -> list[int]:
        with torch.cuda.stream(stream):
            registers = out.cpu().to(torch.int64) & 0xFFFFFFFF
        sizes, which = torch.unique(lengths, return_inverse=True)
        ones = torch.tensor([finish(0, n) for n in sizes.tolist()], dtype=torch.int64)  # the all-ones start, per length
        return (registers ^ ones[which]).tolist()
    return wait


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A kernel's table on ``device``, copied without waiting for the work queued before it on
    the stream (a copy from pageable memory waits for all of it): from page-locked memory,
    which torch keeps until the copy has run."""
    return table.pin_memory().to(device, non_blocking=True)


def spans_eligible(memory: torch.Tensor, begins: Sequence[int], ends: Sequence[int]) -> bool:
    """Whether ``span_crcs`` takes these ranges of ``memory``: each non-empty and whole aligned
    32-bit words."""
    if not begins or memory.data_ptr() % 4:
        return False
    if len(begins) <= 16:  # a piece of one or a few tensors: cheaper without tensors
        return all(b % 4 == 0 and e % 4 == 0 and 0 < e - b < SPAN_UP_TO for b, e in zip(begins, ends, strict=True))
    lo, hi = torch.tensor(begins, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64)
    return bool(((lo % 4 == 0) & (hi % 4 == 0) & (hi > lo) & (hi - lo < SPAN_UP_TO)).all())


def eligible(t: torch.Tensor) -> bool:
    """Whether ``crcs`` takes the bytes ``t`` (uint8, 1-d, contiguous): it reads whole aligned
    32-bit words."""
    return GPU_FROM <= t.numel() < GPU_UP_TO and t.numel() % 4 == 0 and t.data_ptr() % 4 == 0


def finish(register: int, nbytes: int) -> int:
    """The CRC-32C of ``nbytes`` bytes whose register from 0 (no inversions) is ``register``:
    the register is linear in the bytes, so add what the initial all-ones contribute."""
    return (register & 0xFFFFFFFF) ^ _ones(nbytes)


@functools.lru_cache(maxsize=1024)  # a state's tensors have few distinct lengths
def _ones(nbytes: int) -> int:
    """What the initial all-ones register and the final inversion add to a CRC of ``nbytes``."""
    return _checksum.multiply(_checksum.shift(nbytes), 0xFFFFFFFF) ^ 0xFFFFFFFF


def usable(device: torch.device) -> bool:
    """Whether the kernel builds, runs and agrees with the host's CRC on ``device``, tried once
    per device and process."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if device not in _kernels:
            _kernels[device] = _built(device)
        return _kernels[device] is not None


@contextlib.contextmanager
def built_meanwhile(device: torch.device | None) -> Iterator[None]:
    """Build the kernels for ``device`` (if a GPU, and not built yet) on a thread of their own
    while the block runs: NVRTC takes a fraction of a second, which a load then overlaps with
    reading the header (``usable`` waits for the build). The thread is joined when the block
    ends, so none outlives it."""
    thread = None
    if device is not None and device.type == "cuda" and torch.version.cuda is not None and torch.cuda.is_available():
        device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        if device not in _kernels and device.index < torch.cuda.device_count():  # else the load says what is wrong
            thread = threading.Thread(target=usable, args=(device,), name="ckptstream-crc-build", daemon=True)
            thread.start()
    try:
        yield
    finally:
        if thread is not None:
            thread.join()


def _built(device: torch.device) -> _Built | None:
    from torch.cuda import _utils  # torch's own loader for NVRTC kernels

    if not hasattr(_utils, "_cuda_load_module"):  # torch before 2.8: checksums on the host
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
        image = _compile(_utils._get_nvrtc_library(), f"sm_{major}{minor}")
        shapes = {"crc32c_tensors": (LANES, WORDS), "crc32c_spans": (SPAN_LANES, SPAN_WORDS)}
        with torch.cuda.device(device):
            # the constants first: copying them makes the device's context current in this
            # thread (a thread of its own, see built_meanwhile), as loading the module needs
            consts = {name: torch.tensor(_constants(lanes, lanes * words * 4), dtype=torch.int64).to(torch.int32)
                      .to(device) for name, (lanes, words) in shapes.items()}  # the bits of uint32 values
            kernels = _utils._cuda_load_module(image, list(shapes))
            builds = [(kernels[name], consts[name]) for name in shapes]  # type: ignore[index]
        built = _kernels[device] = _Built(*builds)  # where crcs finds them for the self-test
        if _self_test(device):
            return built
        warnings.warn(f"ckptstream: the GPU checksum disagrees with the host's on {device}: "
                      "checksumming on the host instead", RuntimeWarning, stacklevel=4)
    except Exception as e:  # no NVRTC library, a failure to compile or run: use the host
        warnings.warn(f"ckptstream: the GPU checksum failed on {device} ({type(e).__name__}: {e}): "
                      "checksumming on the host instead", RuntimeWarning, stacklevel=4)
    return None


def _compile(nvrtc: ctypes.CDLL, arch: str) -> bytes:
    """The kernel's two instances (one program: NVRTC's cost is mostly per program), compiled by
    NVRTC for ``arch`` (e.g. sm_90), as a cubin."""
    shapes = (f"#define TENSOR_LANES {LANES}\n#define TENSOR_WORDS {WORDS}\n#define SPAN_LANES {SPAN_LANES}\n"
              f"#define SPAN_WORDS {SPAN_WORDS}\n#define SHIFTS {_SHIFTS}\n")
    source = (shapes + _SOURCE).encode()
    program = ctypes.c_void_p()
    _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"crc32c.cu", 0, None, None))
    try:
        options = [f"--gpu-architecture={arch}".encode()]
        if nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options)):
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile the checksum kernel: {log.value.decode()}")
        size = ctypes.c_size_t()
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin))
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _nvrtc_check(nvrtc: ctypes.CDLL, result: int) -> None:
    if result:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC: {nvrtc.nvrtcGetErrorString(result).decode()}")


def _self_test(device: torch.device) -> bool:
    data = torch.randint(0, 256, (3 * BLOCK + 12344,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pieces = [data[8:], data[:4], data[4 : BLOCK + 8]]  # whole 32-bit words, as ``eligible`` admits
    spans = [(0, 4), (4, 1028), (1028, 1032), (1036, 1036 + 3 * SPAN_BLOCK + 8)]
    on_device = data.to(device)
    want = [_checksum.crc_of(bytes(data[a:b].tolist())) for a, b in spans]  # (numpy is not a dependency)
    return (crcs([p.to(device) for p in pieces]) == [_checksum.crc_of(bytes(p.tolist())) for p in pieces]
            and span_crcs(on_device, [a for a, _ in spans], [b for _, b in spans]) == want)
