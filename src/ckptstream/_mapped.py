"""``load(..., mmap=True)``: CPU tensors backed by a private mapping of the checkpoint file.

A copying load moves every byte through memory twice (page cache -> staging or tensor); a mapped
load moves none: each tensor is a view of a copy-on-write mapping (``MAP_PRIVATE``, readable and
writable) of the file, and its pages come from the page cache when first touched. Writes to the
tensors stay in this process. With checksums, every tensor's CRC-32C is computed over the mapped
bytes at load time, several threads taking contiguous runs of the data section (large tensors cut
into pieces whose CRCs are combined), so a corrupt tensor is reported before the state is
returned. Without, nothing is read up front.

The mapping is the source's (``Source.map``: a local file maps, holding the file but no
descriptor); it is unmapped when the last tensor backed by it is freed. A storage that cannot
map (an object store) gets a clear error.

The file must not be truncated or modified in place while the tensors live: pages not yet read
would show the new bytes, and pages past a truncation raise SIGBUS. ckptstream's own saves
replace a file by rename, which leaves the mapped (old) file intact.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _checksum, _gc
from ._engine import control
from ._errors import TruncatedFileError, UnsupportedStorageError
from ._header import TensorInfo, empty_tensor
from ._progress import progress_bar
from ._storage import Region, round_down

if TYPE_CHECKING:
    from ._reader import CheckpointReader

PIECE = 16 << 20  # bytes per checksum piece: a large tensor is checksummed by several threads
THREADED_FROM = 8 << 20  # smaller data sections are checksummed in the caller's thread
# Below this mean piece size the checksum pass is bound by Python's per-call work, which holds
# the GIL: more threads would only take turns on it.
THREADED_MEAN = 1 << 20


def _tensor(region: Region, info: TensorInfo, at: int) -> torch.Tensor:
    """The stored tensor ``info`` whose bytes start ``at`` bytes into the mapped ``region``
    (mapped from a page-aligned offset)."""
    if info.nbytes == 0:
        return empty_tensor(info.shape, info.dtype, torch.device("cpu"))
    if at % info.dtype.itemsize:
        # an offset that is not a multiple of the element size (possible in files of other
        # writers): torch's kernels assume aligned elements, so these bytes are copied
        raw = torch.frombuffer(region.buffer, dtype=torch.uint8, count=info.nbytes, offset=at).clone()
        return raw.view(info.dtype).view(info.shape)
    count = info.nbytes // info.dtype.itemsize
    return torch.frombuffer(region.buffer, dtype=info.dtype, count=count, offset=at).view(info.shape)


def mapped_tensors(reader: CheckpointReader, device: torch.device, *, checksum: bool = True,
                   progress: bool = False) -> dict[str, torch.Tensor]:
    """Every stored tensor of ``reader``'s file, by its table name, as CPU tensors backed by a
    private mapping of the file; with ``checksum``, each is compared with its stored CRC-32C
    first (CorruptCheckpointError naming the tensor and the file)."""
    check_device(device)
    header = reader.header
    infos = header.tensors
    end = header.data_start + header.data_bytes
    if header.data_bytes == 0:  # nothing to map (no tensors, or none with bytes)
        return {t.name: empty_tensor(t.shape, t.dtype, device) for t in infos}
    start = round_down(header.data_start, mmap.PAGESIZE)
    mapping = reader._source.map(start, end - start)
    if mapping is None:
        raise UnsupportedStorageError(f"{reader.path}: mmap=True maps a local file, and this storage cannot map its "
                                      "objects: load without mmap=True")
    size = reader._source.size()
    if size < end:  # shortened since its header was read: a touch past the end would raise SIGBUS
        raise TruncatedFileError(reader.path, header.data_start, header.data_bytes, max(0, size - header.data_start))
    base = header.data_start - start
    with progress_bar(progress, header.data_bytes, f"load {os.path.basename(reader.path)}") as bar:
        if checksum and header.crcs is not None:
            spans = [(base + t.begin, base + t.end) for t in infos]
            computed = span_crcs(mapping, spans, threads(reader._cfg.io_threads, reader._cfg.hot_io_threads), bar)
            reader._compare([(t.name, crc) for t, crc in zip(infos, header.crcs, strict=True)], computed)
        elif bar is not None:
            bar(header.data_bytes)
    with _gc.paused():
        return {t.name: _tensor(mapping, t, base + t.begin) for t in infos}


def check_device(device: Any) -> None:
    """ValueError unless ``device`` names the CPU, where a mapping of the file can back tensors."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"mmap=True maps the file into CPU memory, so it loads to device='cpu' only, got "
                         f"device={str(device)!r}: load with device='cpu' (and move the tensors), or without mmap=True "
                         "to load straight onto that device")


def threads(io_threads: int, hot_io_threads: int) -> int:
    """Checksum threads: the settings' larger thread count, at most one per core (checksums over
    mapped memory are bound by the CPU, or by page faults that more threads overlap)."""
    return max(1, min(max(io_threads, hot_io_threads), os.cpu_count() or 1))


def span_crcs(mapping: Region, spans: Sequence[tuple[int, int]], nthreads: int,
              bar: Callable[[int], None] | None = None) -> list[int]:
    """The CRC-32C of each byte span [lo, hi) of the mapping (spans in file order, back to back
    or not), computed by up to ``nthreads`` threads, each over a contiguous run of pieces."""
    parts, total = _pieces(spans)
    if total < THREADED_FROM or total < THREADED_MEAN * len(parts):
        nthreads = 1
    nthreads = max(1, min(nthreads, len(parts)))
    runs = _split(parts, total, nthreads)
    crcs = [0] * len(parts)
    view = memoryview(mapping.buffer).cast("B")
    stop = threading.Event()
    errors: list[BaseException] = []

    def work(first: int, last: int) -> None:
        try:
            if first < last:
                # one call brings the run's pages in; where refused, the reads below fault them in
                mapping.prefetch(parts[first][1], parts[last - 1][2])
            for k in range(first, last):
                if stop.is_set():
                    return
                _, lo, hi = parts[k]
                crcs[k] = _checksum.crc_of(view[lo:hi])
                if bar is not None:
                    bar(hi - lo)
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)
            stop.set()

    workers = [threading.Thread(target=work, args=run, name=f"ckptstream-crc-{i}", daemon=True)
               for i, run in enumerate(runs[1:], 1)]
    started: list[threading.Thread] = []
    try:
        for w in workers:
            w.start()
            started.append(w)
        work(*runs[0])
    finally:
        control.join(started, on_interrupt=stop.set)  # each worker stops after its current piece
    if errors:
        raise errors[0]
    values = [0] * len(spans)
    for (i, lo, hi), crc in zip(parts, crcs, strict=True):
        values[i] = _checksum.combine(values[i], crc, hi - lo)
    return values


def _pieces(spans: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int, int]], int]:
    """(span, lo, hi) pieces of at most PIECE bytes of every span, and their bytes in all."""
    parts: list[tuple[int, int, int]] = []
    total = 0
    for i, (lo, hi) in enumerate(spans):
        total += hi - lo
        if hi - lo <= PIECE:
            parts.append((i, lo, hi))
        else:
            parts.extend((i, p, min(p + PIECE, hi)) for p in range(lo, hi, PIECE))
    return parts, total


def _split(parts: Sequence[tuple[int, int, int]], total: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous runs [first, last) of ``parts`` with about equal bytes each."""
    runs, first, done = [], 0, 0
    for r in range(1, n):
        goal, k = total * r // n, first
        while k < len(parts) and done < goal:
            done += parts[k][2] - parts[k][1]
            k += 1
        runs.append((first, k))
        first = k
    runs.append((first, len(parts)))
    return runs
