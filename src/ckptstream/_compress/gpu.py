"""A CUDA tensor's chunks compressed and decompressed on its GPU, with nvCOMP's Zstd in its RAW
bitstream: each chunk one standard zstd frame, the frames that ``chunks`` writes and reads on the
CPU with ``zstandard`` (measured both ways, exact: docs/compression.md, "Measured on the GPU").
So a chunk list made here decodes with ``chunks.decode`` on a machine without a GPU, and one made
by ``chunks.encode`` decodes here.

Byte-grouping and the CRC-32C of each chunk's uncompressed bytes run on the GPU too (the CRC
with the loads' span kernel, ``_engine.gpucrc``; on the host where it is not built). All chunks
of a tensor go in one batched call each way: nvCOMP is fast only with many chunks in flight.
Needs the ``nvidia-nvcomp-cu12`` or ``-cu13`` package of the machine's CUDA; ``available`` says
whether it imports.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

from .. import _checksum
from .._engine import gpucrc
from .._errors import CorruptCheckpointError
from . import grouping
from .chunks import KEEP_BELOW, Chunk

FRAME_ALIGN = 256  # frames uploaded for decoding start at multiples of this (nvCOMP asks for 16 at least)


@functools.lru_cache(maxsize=1)
def _nvcomp() -> Any:
    try:
        import nvidia.nvcomp as nvcomp  # type: ignore[import-not-found]  # optional, GPU machines only
    except ImportError as e:
        raise ImportError("compressing on the GPU needs nvCOMP's Python package: pip install nvidia-nvcomp-cu13 "
                          "(or -cu12, after the CUDA of your torch build)") from e
    return nvcomp


def available() -> bool:
    """Whether nvCOMP imports (the GPU codec can run where a CUDA device is)."""
    try:
        _nvcomp()
    except ImportError:
        return False
    return True


def _codec(device: torch.device, chunk_bytes: int) -> Any:
    nv = _nvcomp()
    stream = torch.cuda.current_stream(device).cuda_stream
    return nv.Codec(algorithm="Zstd", bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=chunk_bytes,
                    device_id=device.index if device.index is not None else torch.cuda.current_device(),
                    cuda_stream=stream), stream


def _group_into(data: torch.Tensor, planes: torch.Tensor, bounds: list[tuple[int, int]], stride: int,
                width: int) -> None:
    """Chunk k of ``data`` (``bounds[k]``), byte-grouped (a plain copy for a width of 1), at
    ``planes[k * stride:]``: the full chunks in one batched transpose, a shorter last one alone."""
    full = sum(1 for lo, hi in bounds if hi - lo == stride)
    if full:
        src = data[: full * stride].view(full, stride // width, width)
        planes[: full * stride].view(full, width, stride // width).copy_(src.transpose(1, 2))
    for k in range(full, len(bounds)):
        lo, hi = bounds[k]
        planes[k * stride : k * stride + hi - lo] = grouping.group(data[lo:hi], width)


def _ungroup_into(planes: torch.Tensor, data: torch.Tensor, bounds: list[tuple[int, int]], stride: int,
                  width: int, which: list[int]) -> None:
    """The inverse of ``_group_into`` for the chunks ``which`` (ascending): each run of
    consecutive full chunks in one batched transpose, any other chunk alone."""
    def full(k: int) -> bool:
        return bounds[k][1] - bounds[k][0] == stride

    runs: list[list[int]] = []
    for k in which:
        if runs and runs[-1][-1] == k - 1 and full(k - 1) and full(k):
            runs[-1].append(k)
        else:
            runs.append([k])
    for run in runs:
        a, b = run[0], run[-1] + 1
        lo, hi = bounds[a][0], bounds[b - 1][1]
        if hi - lo == (b - a) * stride:
            src = planes[a * stride : b * stride].view(b - a, width, stride // width)
            data[lo:hi].view(b - a, stride // width, width).copy_(src.transpose(1, 2))
        else:  # one shorter chunk
            data[lo:hi] = grouping.ungroup(planes[a * stride : a * stride + hi - lo], width)


def _crcs(data: torch.Tensor, bounds: list[tuple[int, int]]) -> list[int]:
    """The CRC-32C of each chunk of ``data``: on the GPU where the span kernel takes it (whole
    32-bit words), else on the host."""
    on_gpu = [k for k, (lo, hi) in enumerate(bounds) if lo % 4 == 0 and hi % 4 == 0 and hi > lo]
    out = [0] * len(bounds)
    if on_gpu and gpucrc.usable(data.device) and data.data_ptr() % 4 == 0:
        got = gpucrc.span_crcs(data, [bounds[k][0] for k in on_gpu], [bounds[k][1] for k in on_gpu])
        for k, crc in zip(on_gpu, got, strict=True):
            out[k] = crc
    else:
        on_gpu = []
    for k in set(range(len(bounds))) - set(on_gpu):
        lo, hi = bounds[k]
        out[k] = _checksum.crc_of(data[lo:hi].cpu().numpy().data)
    return out


def encode(t: torch.Tensor, chunk_bytes: int, width: int, *, keep_below: float = KEEP_BELOW) -> list[Chunk]:
    """The chunks of CUDA tensor ``t``'s logical bytes, as ``chunks.encode`` makes them with a zstd
    codec: grouped by ``width``, each one zstd frame, or its bytes as is where the frame would not
    be at most ``keep_below`` of them."""
    data = grouping.tensor_bytes(t)
    bounds = grouping.chunk_bounds(data.numel(), chunk_bytes, width)
    if not bounds:
        return []
    nv = _nvcomp()
    codec, stream = _codec(t.device, chunk_bytes)
    planes = torch.empty(len(bounds) * chunk_bytes, dtype=torch.uint8, device=t.device)
    _group_into(data, planes, bounds, chunk_bytes, width)
    crcs = _crcs(data, bounds)
    sizes = [hi - lo for lo, hi in bounds]
    frames = codec.encode(nv.as_arrays(planes, [k * chunk_bytes for k in range(len(bounds))], sizes, stream))
    lengths = frames.buffer_sizes  # waits for the compression
    out = []
    for k, (lo, hi) in enumerate(bounds):
        if lengths[k] <= keep_below * (hi - lo):
            out.append(Chunk(from_dlpack(frames[k]).cpu().numpy().tobytes(), False, hi - lo, crcs[k]))
        else:
            out.append(Chunk(data[lo:hi].cpu().numpy().tobytes(), True, hi - lo, crcs[k]))
    return out


def decode(stored: list[Chunk], width: int, out: torch.Tensor, *, name: str = "tensor") -> None:
    """Fill ``out`` (a contiguous CUDA tensor of the stored dtype and shape) from its chunks (zstd
    frames, or bytes kept as is), on its GPU, each checked against its CRC; a chunk that fails
    is named in the CorruptCheckpointError, as ``chunks.decode`` names it."""
    if out.device.type != "cuda" or not out.is_contiguous():
        raise ValueError(f"{name}: decoding on the GPU fills a contiguous CUDA tensor, got one on {out.device} "
                         f"(contiguous: {out.is_contiguous()})")
    dst = out.reshape(-1).view(torch.uint8)
    total = sum(c.size for c in stored)
    if total != dst.numel():
        raise CorruptCheckpointError(f"{name}: its chunks hold {total} bytes, its dtype and shape {dst.numel()}")
    if not stored:
        return
    for k, c in enumerate(stored):
        if c.size % width:
            raise CorruptCheckpointError(f"{name}: chunk {k} holds {c.size} bytes, not whole {width}-byte values")
    bounds = list(itertools.pairwise(itertools.accumulate((c.size for c in stored), initial=0)))
    stride = max(c.size for c in stored)
    framed = [k for k, c in enumerate(stored) if not c.raw]
    for k, c in enumerate(stored):
        if c.raw:
            if len(c.data) != c.size:
                raise CorruptCheckpointError(f"{name}: chunk {k} is stored as {len(c.data)} bytes, expected {c.size}")
            dst[bounds[k][0] : bounds[k][1]] = torch.frombuffer(bytearray(c.data), dtype=torch.uint8).to(out.device)
    if framed:
        _decode_frames(stored, framed, bounds, stride, width, dst, name)
    for k, crc in enumerate(_crcs(dst, bounds)):
        if crc != stored[k].crc:
            lo, hi = bounds[k]
            raise CorruptCheckpointError(f"{name}: chunk {k} (uncompressed bytes {lo}..{hi}) does not match its "
                                         f"CRC-32C {stored[k].crc:08x}")


def _decode_frames(stored: list[Chunk], framed: list[int], bounds: list[tuple[int, int]], stride: int, width: int,
                   dst: torch.Tensor, name: str) -> None:
    """The framed chunks ``framed`` decoded into ``dst`` in one batched call."""
    nv = _nvcomp()
    offsets = [0]
    for k in framed:
        offsets.append(offsets[-1] + len(stored[k].data) + (-len(stored[k].data) % FRAME_ALIGN))
    host = torch.zeros(offsets[-1], dtype=torch.uint8).pin_memory()
    for at, k in zip(offsets[:-1], framed, strict=True):
        host[at : at + len(stored[k].data)] = torch.frombuffer(bytearray(stored[k].data), dtype=torch.uint8)
    frames = host.to(dst.device, non_blocking=True)
    codec, stream = _codec(dst.device, stride)
    planes = torch.empty(len(stored) * stride, dtype=torch.uint8, device=dst.device)  # chunk k at k * stride
    sizes = [bounds[k][1] - bounds[k][0] for k in framed]
    try:
        done = codec.decode(nv.as_arrays(frames, offsets[:-1], [len(stored[k].data) for k in framed], stream),
                            out=nv.as_arrays(planes, [k * stride for k in framed], sizes, stream))
        got = done.buffer_sizes
    except Exception as e:  # nvCOMP's own error types: a frame it cannot decode
        raise CorruptCheckpointError(f"{name}: its chunks do not decode as zstd frames: {e}") from e
    for k, n, want in zip(framed, got, sizes, strict=True):
        if n != want:
            raise CorruptCheckpointError(f"{name}: chunk {k} decodes to {n} bytes, expected {want}")
    _ungroup_into(planes, dst, bounds, stride, width, framed)
