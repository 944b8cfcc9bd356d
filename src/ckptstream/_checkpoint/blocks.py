"""Where a whole load puts its tensors: few allocations, each holding a run of the file's tensors
at their file positions, and the pieces and checksum spans that fill them.

A load of many small tensors pays per allocation and per copy more than per byte; so tensors
that lie back to back in the file share one allocation (up to ``BLOCK`` bytes), come back as
views of it, and the engine moves the whole run (padding and all) as one piece, while each
tensor keeps a checksum span of its own. On a device, tensors below ``SMALL`` share; in host
memory, tensors below ``BLOCK``: fresh host memory costs a page fault per page on first touch
(more than the copy that fills it), which huge pages mostly avoid, and allocations of a few MiB
get few of them. Larger tensors get an allocation each, so that dropping one frees its memory;
a shared allocation is freed with the last of its tensors.

Host memory is an anonymous mapping advised for huge pages, placed so that memory and file
agree modulo the page size; device memory agrees with the file modulo 16 bytes. A tensor whose
file offset is not aligned to its element size (possible in foreign files) then cannot be a view
at its file position: it gets an ordinary allocation of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
from collections.abc import Collection, Sequence

import torch

from .._engine import Piece, empty_tensor
from .._format.header import TensorInfo

SMALL = 1 << 20  # device tensors below share allocations
# Host tensors below this are gathered by ``host_scratch``, in runs of at least HOST_RUN back to
# back in the file: there a piece of its own costs the read engine more than the copy from scratch
# memory; a larger tensor costs more to copy, and a few in a run save less than the checksums by
# span (which the runs need) cost the other pieces of the read.
HOST_SMALL = 16 << 10
HOST_RUN = 8
BLOCK = 64 << 20  # the most bytes one shared allocation spans; host tensors below share
HUGE = 2 << 20  # host allocations from this size are advised for huge pages
PAGE = mmap.PAGESIZE
_CONGRUENCE = 16  # device memory agrees with the file modulo this (the widest element)
_PACKED = {getattr(torch, "float4_e2m1fn_x2", None)} - {None}  # stored shapes count packed pairs


@dataclasses.dataclass
class Destinations:
    """The tensors of a load by stored name, and what the read engine fills them with: pieces
    (one per allocation) and spans (file ranges, one per tensor with bytes) named by ``names``."""

    tensors: dict[str, torch.Tensor]
    pieces: list[Piece]
    spans: list[tuple[int, int]]
    names: list[str]  # the stored tensor of each span


def arrange(infos: Sequence[TensorInfo], data_start: int, device: torch.device,
            alone: Collection[str] = ()) -> Destinations:
    """Allocate every stored tensor of ``infos`` (in file order; a run ends where the next one
    does not follow back to back) on ``device`` in few allocations;
    those named in ``alone`` (the bases of views, which may view their bytes as any dtype) get an
    allocation of their own."""
    out = Destinations({}, [], [], [])
    run: list[TensorInfo] = []
    shared_below = shared_below_on(device)
    for t in infos:
        if (t.end == t.begin or t.dtype in _PACKED or (data_start + t.begin) % t.dtype.itemsize
                or t.name in alone):
            _flush(out, run, data_start, device)
            run = []
            out.tensors[t.name] = _alone(out, t, data_start, device)
            continue
        if t.nbytes >= shared_below or (run and (t.begin != run[-1].end or t.end - run[0].begin > BLOCK)):
            _flush(out, run, data_start, device)
            run = []
        run.append(t)
        if t.nbytes >= shared_below:  # a run of its own: dropping it frees its memory
            _flush(out, run, data_start, device)
            run = []
    _flush(out, run, data_start, device)
    return out  # runs are flushed in file order: so are the spans


@dataclasses.dataclass
class HostScratch:
    """Host memory that runs of small stored tensors are read into (one piece per run), and
    where in it each one's bytes are, for ``move_into`` once they are verified; the tensors of
    runs shorter than HOST_RUN go straight to their destinations (``alone``)."""

    pieces: list[Piece]
    dests: list[torch.Tensor]  # of the tensors moved in, in file order
    sources: list[int]  # per destination: the address of its bytes in the memory
    alone: list[tuple[TensorInfo, torch.Tensor]]
    area: mmap.mmap | None  # the memory, held until the bytes are moved


def host_scratch(infos: Sequence[TensorInfo], dests: Sequence[torch.Tensor], data_start: int) -> HostScratch:
    """Scratch host memory for ``infos`` (small tensors with bytes, in file order, bound for
    ``dests``): one allocation for the runs of them back to back in the file (up to ``BLOCK``
    bytes), a piece per run, each placed where memory and file agree modulo the page size."""
    runs: list[list[int]] = []
    for i, t in enumerate(infos):
        if runs and t.begin == infos[runs[-1][-1]].end and t.end - infos[runs[-1][0]].begin <= BLOCK:
            runs[-1].append(i)
        else:
            runs.append([i])
    out = HostScratch([], [], [], [(infos[i], dests[i]) for run in runs if len(run) < HOST_RUN for i in run], None)
    runs = [run for run in runs if len(run) >= HOST_RUN]
    places, size = [], 0
    for run in runs:
        lo, hi = infos[run[0]].begin, infos[run[-1]].end
        at = size + (data_start + lo - size) % PAGE
        places.append(at)
        size = at + hi - lo
    if not runs:
        return out
    out.area, _ = host_area(size, 0)
    memory = torch.frombuffer(out.area, dtype=torch.uint8)
    base = memory.data_ptr()
    for run, at in zip(runs, places, strict=True):
        first = infos[run[0]].begin
        out.pieces.append(Piece.of(memory[at : at + infos[run[-1]].end - first], data_start + first))
        out.dests.extend(dests[i] for i in run)
        out.sources.extend(base + at + infos[i].begin - first for i in run)
    return out


def move_into(destinations: Sequence[torch.Tensor], sources: Sequence[int]) -> None:
    """Copy each source's bytes (an address in scratch host memory) into its destination (a
    plain, contiguous host tensor of as many bytes): one C call each, no torch call."""
    move = ctypes.memmove
    for dst, src in zip(destinations, sources, strict=True):
        move(dst.data_ptr(), src, dst.nbytes)


def shared_below_on(device: torch.device) -> int:
    """The size from which a tensor gets an allocation of its own on ``device``."""
    return BLOCK if device.type == "cpu" else SMALL


def _alone(out: Destinations, t: TensorInfo, data_start: int, device: torch.device) -> torch.Tensor:
    """An unaligned, packed or empty tensor, or a view's base: an allocation of its own, filled
    as its own piece."""
    tensor = empty_tensor(t.shape, t.dtype, device)
    if t.end > t.begin:
        out.pieces.append(Piece.of(tensor, data_start + t.begin))
        out.spans.append((data_start + t.begin, data_start + t.end))
        out.names.append(t.name)
    return tensor


def _flush(out: Destinations, run: list[TensorInfo], data_start: int, device: torch.device) -> None:
    """One allocation for ``run`` (aligned tensors back to back in the file), its views, its piece."""
    if not run:
        return
    begin, end = data_start + run[0].begin, data_start + run[-1].end
    if device.type == "cpu":
        area, shift = host_area(end - begin, begin)
        memory = torch.frombuffer(area, dtype=torch.uint8)[shift : shift + end - begin]
        out.tensors.update(_host_views(memoryview(area)[shift:], run))
    else:
        # a tensor alone starts its allocation (storage offset 0); a run keeps its elements aligned
        memory = device_memory(end - begin, begin if len(run) > 1 else 0, device)
        out.tensors.update(_device_views(memory, run))
    out.pieces.append(Piece.of(memory, begin))
    out.spans.extend((data_start + t.begin, data_start + t.end) for t in run)
    out.names.extend(t.name for t in run)


def _host_views(mv: memoryview, run: list[TensorInfo]) -> dict[str, torch.Tensor]:
    """Host tensors each with a storage of its own over its bytes in ``mv`` (storage offset 0,
    as some torch functions, e.g. ``torch.set_rng_state``, assume), all keeping the mapping alive."""
    begin, views = run[0].begin, {}
    for t in run:
        flat = torch.frombuffer(mv[t.begin - begin : t.end - begin], dtype=t.dtype)
        views[t.name] = flat if len(t.shape) == 1 else flat.view(t.shape)
    return views


def _device_views(memory: torch.Tensor, run: list[TensorInfo]) -> dict[str, torch.Tensor]:
    """Device tensors as views of the allocation (one call each)."""
    storage, base = memory.untyped_storage(), memory.storage_offset() - run[0].begin
    typed: dict[torch.dtype, torch.Tensor] = {}
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # states repeat a few shapes many times
    views = {}
    for t in run:
        dtype, size = t.dtype, t.dtype.itemsize
        if dtype not in typed:
            typed[dtype] = torch.empty(0, dtype=dtype, device=memory.device).set_(
                storage, 0, (storage.nbytes() // size,), (1,))
        shape = t.shape
        if shape not in strides:
            strides[shape] = _strides(shape)
        views[t.name] = typed[dtype].as_strided(shape, strides[shape], (base + t.begin) // size)
    return views


def device_memory(nbytes: int, file_offset: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of uint8 device memory whose address agrees with ``file_offset`` modulo 16."""
    shift = file_offset % _CONGRUENCE
    return torch.empty(nbytes + shift, dtype=torch.uint8, device=device)[shift:]


def host_area(nbytes: int, file_offset: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping that holds ``nbytes`` from byte ``shift`` on, where ``shift`` makes
    the address agree with ``file_offset`` modulo the page size; advised for huge pages."""
    shift = file_offset % PAGE
    size = -(-(nbytes + shift) // PAGE) * PAGE
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages then
            area.madvise(mmap.MADV_HUGEPAGE)
    return area, shift


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [1] * len(shape), 1
    for i in range(len(shape) - 1, 0, -1):
        step *= max(shape[i], 1)
        strides[i - 1] = step
    return tuple(strides)
