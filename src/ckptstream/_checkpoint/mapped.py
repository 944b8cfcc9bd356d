"""The mapped load: CPU tensors backed by a private mapping of the checkpoint file, what
``load(device="cpu")`` returns by default (``mmap=None``; ``mmap=True`` insists on it).

A copying load moves every byte through memory twice (page cache -> staging or tensor); a mapped
load moves none: each tensor is a view of a copy-on-write mapping (``MAP_PRIVATE``, readable and
writable) of the file, and its pages come from the page cache when first touched. Writes to the
tensors stay in this process. With checksums, every tensor's CRC-32C is computed over the mapped
bytes at load time, several threads taking tasks of a few MiB of the data section in file order
(large tensors cut into pieces whose CRCs are combined) while the caller's thread makes the
tensors and the state, taking a task of its own between batches of tensors, then joins them; so
a corrupt tensor is reported before the state is returned, and every byte has been read once.
Pages already in the page cache are read as they are (fault-around maps many per fault); the
others are brought in a task at a time first. Without checksums, nothing is read up front.

The mapping is the source's (``Source.map``: a local file maps, holding the file but no
descriptor); it is unmapped when the last tensor backed by it is freed. A storage that cannot
map (an object store) gets a clear error with ``mmap=True``, and the copying load by default.

The file must not be truncated or modified in place while the tensors live: pages not yet read
would show the new bytes, and pages past a truncation raise SIGBUS. ckptstream's own saves
replace a file by rename, which leaves the mapped (old) file intact.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from .. import _checksum, _gc
from .._engine import control, empty_tensor
from .._errors import TruncatedFileError, UnsupportedStorageError
from .._format.header import Header, TensorInfo
from .._progress import progress_bar
from .._storage import Region, Source, round_down

if TYPE_CHECKING:
    from .reader import Device

PIECE = 4 << 20  # bytes per checksum piece: a large tensor is checksummed by several threads
TASK = 4 << 20  # bytes a thread takes at a time (runs of small tensors grouped up to it): small
# enough that the threads end together, large enough that each call brings in many pages
RELEASES_GIL = 32 << 10  # the checksum of this many bytes or more releases the GIL (crc32c's rule)
THREADED_FROM = 8 << 20  # fewer bytes in large pieces are checksummed in the caller's thread
BATCH = 64  # tensors made between two of the caller's checksum tasks while the others run
T = TypeVar("T")


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
    flat = torch.frombuffer(region.buffer, dtype=info.dtype, count=count, offset=at)
    return flat if len(info.shape) == 1 else flat.view(info.shape)  # one call less per tensor


Compare = Callable[[Sequence[tuple[str, int]], Sequence[int]], None]  # stored (name, CRC), computed: raises


def mapped_load(path: str, source: Source, header: Header, device: torch.device,
                build: Callable[[dict[str, torch.Tensor]], T], *, nthreads: int, compare: Compare,
                checksum: bool = True, progress: bool = False, required: bool = True) -> tuple[bool, T | None]:
    """``build`` of every stored tensor of the file at ``path`` (open as ``source``, its header
    read), by its table name, as CPU tensors backed by a private mapping of the file; with
    ``checksum``, the tensors' CRC-32C (on ``nthreads`` threads) go to ``compare`` before the
    result is returned (it raises CorruptCheckpointError naming the tensor and the file). The
    checksums run while this thread makes the tensors and calls ``build``, then this thread
    joins them. Returns (False, None), having read nothing, where ``required`` is False and the
    storage cannot map the file."""
    check_device(device)
    infos = header.tensors
    end = header.data_start + header.data_bytes
    if header.data_bytes == 0:  # nothing to map (no tensors, or none with bytes)
        return True, build({t.name: empty_tensor(t.shape, t.dtype, device) for t in infos})
    start = round_down(header.data_start, mmap.PAGESIZE)
    try:
        mapping = source.map(start, end - start)
    except OSError:
        if required:
            raise
        mapping = None  # a file system that refuses mappings: the copying load reads it
    if mapping is None:
        if not required:
            return False, None
        raise UnsupportedStorageError(f"{path}: mmap=True maps a local file, and this storage cannot map its "
                                      "objects: load without mmap=True")
    size = source.size()
    if size < end:  # shortened since its header was read: a touch past the end would raise SIGBUS
        raise TruncatedFileError(path, header.data_start, header.data_bytes, max(0, size - header.data_start))
    base = header.data_start - start

    def tensors(share: Callable[[], None] = lambda: None) -> T:
        made: dict[str, torch.Tensor] = {}
        with _gc.paused():
            for lo in range(0, len(infos), BATCH):
                made.update({t.name: _tensor(mapping, t, base + t.begin) for t in infos[lo:lo + BATCH]})
                share()
            return build(made)

    with progress_bar(progress, header.data_bytes, f"load {os.path.basename(path)}") as bar:
        if checksum and header.crcs is not None:
            spans = [(base + t.begin, base + t.end) for t in infos]
            computed, out = span_crcs(mapping, spans, nthreads, bar, meanwhile=tensors, name=path)
            compare([(t.name, crc) for t, crc in zip(infos, header.crcs, strict=True)], computed)
            return True, out
        if bar is not None:
            bar(header.data_bytes)
    return True, tensors()


def check_device(device: Device) -> None:
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
              bar: Callable[[int], None] | None = None, *,
              meanwhile: Callable[[Callable[[], None]], T] | None = None,
              name: str = "the mapping") -> tuple[list[int], T | None]:
    """The CRC-32C of each byte span [lo, hi) of the mapping (spans in file order, back to back
    or not), and what ``meanwhile(share)`` returns, where ``meanwhile`` calls ``share()`` now
    and then. ``name`` names the file in messages.

    Checksum calls over large pieces release the GIL, over small ones they hold it. So the
    other threads (up to ``nthreads`` in all) take only tasks of large pieces (contiguous runs
    of about TASK bytes in file order), while this thread runs ``meanwhile`` (Python work),
    checksums the small pieces, then takes the tasks left: a thread that holds the GIL for long
    never keeps another from its next large piece for long. A thread back from a checksum call
    waits for the GIL while this thread runs Python (up to the switch interval), so each
    ``share()`` checksums one task here, whose calls hand the GIL to the waiting threads for
    their next pieces: the threads checksum while the state is made. A task whose pages are not
    in the page cache is brought in with one call first (large reads); one whose pages are is
    read as it is: its reads fault the pages in many at a time, for less than that call costs.
    """
    parts = _pieces(spans)
    small, tasks, nthreads = _shares(parts, nthreads)
    run = _Run(mapping, parts, tasks, bar)
    workers = [threading.Thread(target=run.work, name=f"ckptstream-crc-{i}", daemon=True) for i in range(1, nthreads)]
    out: T | None = None
    try:
        # a Ctrl-C here stops the workers and is raised once each started one is listed to join
        with control.interrupts_deferred(run.stop.set):
            for i, w in enumerate(workers, 2):
                control.start(w, f"checksum thread {i} of {nthreads} for {name}")
                run.started.append(w)
        try:
            out = meanwhile(run.share) if meanwhile is not None else None
            run.checksum(small)
        except BaseException:
            run.stop.set()
            raise
        run.work()
    finally:
        control.join(run.started, on_interrupt=run.stop.set)  # each worker stops after its current piece
    if run.errors:
        raise run.errors[0]
    folded = [(i, crc, hi - lo) for (i, lo, hi), crc in zip(parts, run.crcs, strict=True)]
    return _checksum.span_crcs(len(spans), [folded]), out


class _Run:
    """The checksums of one ``span_crcs``: the pieces' CRCs so far, the tasks any thread takes,
    and the first error of a thread."""

    def __init__(self, mapping: Region, parts: Sequence[tuple[int, int, int]], tasks: Sequence[Sequence[int]],
                 bar: Callable[[int], None] | None) -> None:
        self.mapping, self.parts, self.tasks, self.bar = mapping, parts, tasks, bar
        self.view = memoryview(mapping.buffer).cast("B")
        self.crcs = [0] * len(parts)
        # asked here, before the threads start: a call that releases the GIL costs a thread that
        # wants it back while another runs Python up to the switch interval
        self.cold = [not mapping.resident(parts[ks[0]][1], parts[ks[-1]][2]) for ks in tasks]
        self.taken = itertools.count()  # the next task: next() on it is atomic under the GIL
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.started: list[threading.Thread] = []

    def checksum(self, ks: Sequence[int]) -> None:
        for k in ks:
            if self.stop.is_set():
                return
            _, lo, hi = self.parts[k]
            self.crcs[k] = _checksum.crc_of(self.view[lo:hi])
            if self.bar is not None:
                self.bar(hi - lo)

    def task(self) -> bool:
        """Checksum the next task; False once none is left."""
        t = next(self.taken)
        if t >= len(self.tasks):
            return False
        ks = self.tasks[t]
        if self.cold[t]:  # one call brings the pages in; where refused, the reads fault them in
            self.mapping.prefetch(self.parts[ks[0]][1], self.parts[ks[-1]][2])
        self.checksum(ks)
        return True

    def share(self) -> None:
        """One task in the caller's thread, where other threads run (so they get the GIL)."""
        if self.started and not self.stop.is_set():
            self.task()

    def work(self) -> None:
        """Tasks until none is left or the run stops; an error stops the run, for the caller."""
        try:
            while not self.stop.is_set() and self.task():
                pass
        except BaseException as e:  # handed to the caller's thread
            self.errors.append(e)
            self.stop.set()


def _pieces(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(span, lo, hi) pieces of at most PIECE bytes of every span."""
    parts: list[tuple[int, int, int]] = []
    for i, (lo, hi) in enumerate(spans):
        if hi - lo <= PIECE:
            parts.append((i, lo, hi))
        else:
            parts.extend((i, p, min(p + PIECE, hi)) for p in range(lo, hi, PIECE))
    return parts


def _shares(parts: Sequence[tuple[int, int, int]], nthreads: int) -> tuple[list[int], list[list[int]], int]:
    """The parts that the caller's thread checksums alone (the small ones, where threads run),
    the tasks that any thread takes, and how many threads run (the caller's included)."""
    large = [k for k, (_, lo, hi) in enumerate(parts) if hi - lo >= RELEASES_GIL]
    if nthreads < 2 or sum(parts[k][2] - parts[k][1] for k in large) < THREADED_FROM:
        return [], _tasks(parts, range(len(parts)), TASK), 1
    small = [k for k, (_, lo, hi) in enumerate(parts) if hi - lo < RELEASES_GIL]
    tasks = _tasks(parts, large, TASK)
    return small, tasks, min(nthreads, len(tasks))


def _tasks(parts: Sequence[tuple[int, int, int]], ks: Iterable[int], size: int) -> list[list[int]]:
    """The parts ``ks`` (in file order) cut into runs of about ``size`` bytes each (a part is
    never cut)."""
    tasks: list[list[int]] = []
    run: list[int] = []
    held = 0
    for k in ks:
        run.append(k)
        held += parts[k][2] - parts[k][1]
        if held >= size:
            tasks.append(run)
            run, held = [], 0
    if run:
        tasks.append(run)
    return tasks
