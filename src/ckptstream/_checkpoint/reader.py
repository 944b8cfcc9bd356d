"""``ckptstream.open``: a lazy, typed view of a checkpoint file, the center of the loading API.

Opening reads and validates the header once (tensor table, structure, checksums); nothing else
is read until asked. Each tensor is indexed by its user-facing key path
("optim.state.0.exp_avg") with its dtype, shape, bytes, checksum and file range; ``read``,
``read_into`` and ``read_slices`` stream just the bytes they need through the read engine.
``load``, ``load_into``, ``verify`` and ``ckptstream inspect`` are thin users of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import _gc
from .._engine import BYTE_COPIED, PLAIN_TENSORS, Piece, ReadEngine, check_tensor, empty_tensor
from .._errors import ChecksumsMissingError, CorruptCheckpointError, NotACheckpointError, StateMismatchError
from .._format import header as _header
from .._format import sniff
from .._format.header import Header
from .._format.slices import normalize_box, slice_pieces
from .._format.structure import KeyPath, View, key_str, make_view, parse_structure, rebuild, unflatten
from .._progress import progress_bar
from .._settings import Settings
from .._storage import Source, storage_for
from . import blocks
from . import mapped as _mapped

# what a user passes as a device: torch.device("cuda:1"), "cuda:1", "cpu" or a CUDA index
Device = str | int | torch.device
Key = str | KeyPath
_FIRST_READ = 1 << 20  # most headers are shorter: read in one call
_SKIP = object()


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, as the reader's index describes it.

    ``stored_as`` is its name in the file's tensor table (what safetensors readers see),
    ``offset``..``end`` the file bytes of that stored tensor and ``checksum`` their CRC-32C
    (None in files without checksums). A tensor saved as a view of memory it shared with other
    tensors (not the same tensor repeated) is stored in a blob of that memory: ``view`` then
    says where in it.
    """

    key: str
    path: KeyPath
    dtype: torch.dtype
    shape: tuple[int, ...]
    stored_as: str
    offset: int
    end: int
    checksum: int | None
    view: View | None = None

    @property
    def nbytes(self) -> int:
        """The tensor's own bytes (a view may use fewer than its stored blob holds)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The dtype's name in the file's tensor table, as safetensors names it ("F32", "BF16")."""
        return _header.DTYPE_NAMES[self.dtype]


_new, _set = object.__new__, object.__setattr__


def _entry(path: KeyPath, dtype: torch.dtype, shape: tuple[int, ...], stored_as: str, offset: int, end: int,
           checksum: int | None, view: View | None) -> TensorEntry:
    """``TensorEntry(key_str(path), path, ...)``, made without the frozen dataclass's __init__
    (one setattr per field): an index of many thousands of tensors is made on every load_into."""
    try:
        key = ".".join(path) if path else "<root>"  # type: ignore[arg-type]
    except TypeError:  # an int key
        key = key_str(path)
    entry = _new(TensorEntry)
    _set(entry, "__dict__", {"key": key, "path": path, "dtype": dtype, "shape": shape, "stored_as": stored_as,
                             "offset": offset, "end": end, "checksum": checksum, "view": view})
    return entry


def as_device(device: Device) -> torch.device:
    """``device`` as a torch.device; ValueError for what names none ("bogus", "cuda:x")."""
    try:
        # an int is a CUDA index (torch.device(0) raises where no accelerator is present)
        return torch.device("cuda", device) if type(device) is int else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device={device!r}: not a device torch knows ({e}); ckptstream loads into 'cpu' or "
                         "'cuda' tensors") from e


def target_device(device: Device) -> torch.device:
    """``device`` as a loads' destination; raises ValueError where tensors cannot land."""
    dev = as_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: torch sees no CUDA device (a CPU-only build, or no visible "
                             "GPU); load to 'cpu' instead")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={str(device)!r}: ckptstream loads into 'cpu' or 'cuda' tensors "
                         "(and ckptstream.load takes 'meta' for the structure alone)")
    return dev


class CheckpointReader:
    """An open checkpoint (ours or any safetensors file); see ``ckptstream.open``."""

    def __init__(self, path: str | os.PathLike[str], cfg: Settings, *, require_checksums: bool = False) -> None:
        self.path, self._cfg = os.fsdecode(path), cfg
        self._source: Source = storage_for(self.path).open(self.path)  # a FIFO is refused, not waited on
        try:
            with _gc.paused():
                self.header = self._read_header()
                if require_checksums:
                    self.require_checksums()
                table = {t.name: t.nbytes for t in self.header.tensors}
                self._structure = parse_structure(self.header.structure, table, self.path)
        except BaseException:
            self._source.close()
            raise

    def require_checksums(self) -> None:
        """Raise ChecksumsMissingError unless the file stores its checksums."""
        if self.header.crcs is None:
            raise ChecksumsMissingError(
                f"{self.path}: holds no checksums (no {_header.CRC_KEY} in its header's __metadata__), and they are "
                "required: it was saved without them (checksum=False, or by another writer), or a tool rewrote its "
                "header without ckptstream's metadata; restore it from a copy that has them, or pass "
                "require_checksums=False to read it unchecked")

    def _read_header(self) -> Header:
        size = self._source.size()
        raw = bytearray(min(size, _FIRST_READ))
        self._source.read_into(memoryview(raw), 0)
        try:
            start = _header.data_start(bytes(raw[:8]), size, self.path)
            if start > len(raw):
                rest = bytearray(start - len(raw))
                self._source.read_into(memoryview(rest), len(raw))
                raw += rest
            return _header.decode(bytes(raw[:start]), size, self.path)
        except CorruptCheckpointError as e:  # a file of another kind says so, not "header length ..."
            other = sniff.recognise(bytes(raw[: sniff.HEAD]), self.path)
            if other is None:
                raise
            raise NotACheckpointError(other.message, self.path, other.kind) from e

    @functools.cached_property
    def _entries(self) -> dict[KeyPath, TensorEntry]:
        """The index, made on first use (a whole load does without it)."""
        h, s = self.header, self._structure
        infos = {t.name: t for t in h.tensors}
        crcs = dict(zip(infos, h.crcs, strict=True)) if h.crcs is not None else {}
        start, views, stored_as = h.data_start, s.views, s.tensors
        entries = {}
        for path in s.paths:
            view = views.get(path)
            if view is None:
                info = infos[stored_as[path]]
                dtype, shape = info.dtype, info.shape
            else:
                info = infos[view.base]
                dtype, shape = view.dtype, view.shape
            entries[path] = _entry(path, dtype, shape, info.name, start + info.begin, start + info.end,
                                   crcs.get(info.name), view)
        return entries

    @functools.cached_property
    def _by_key(self) -> dict[str, KeyPath | None]:
        by_key: dict[str, KeyPath | None] = {}  # None: two paths print alike
        for key_path in self._entries:
            key = key_str(key_path)
            by_key[key] = None if key in by_key else key_path
        return by_key

    # --- the index ------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, str]:
        """The user's metadata (without ckptstream's own keys)."""
        return dict(self.header.metadata)

    @property
    def format(self) -> str:
        """"ckptstream 1" for files written by ckptstream, "safetensors" for others."""
        return self.header.format

    @property
    def data_offset(self) -> int:
        """Where the tensor data starts in the file (the header's length, with its prefix)."""
        return self.header.data_start

    @property
    def data_bytes(self) -> int:
        """The bytes of tensor data the header describes."""
        return self.header.data_bytes

    @property
    def checksummed(self) -> bool:
        """Whether the file stores a CRC-32C of every tensor (and of its header)."""
        return self.header.crcs is not None

    def keys(self) -> list[Key]:
        """The key path of every tensor, once each, in the state's order (``"model.w"``,
        ``"optim.state.0.step"``), each one that ``entry`` and ``read`` take: a path whose string
        another path shares (``{"a.b": x, "a": {"b": y}}``; an int key and its str twin) as its
        tuple of keys (``("a.b",)`` and ``("a", "b")``)."""
        by_key = self._by_key
        return [e.key if by_key[e.key] is not None else e.path for e in self._entries.values()]

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return (isinstance(key, str) and self._by_key.get(key) is not None) or key in self._entries

    def entry(self, key: Key) -> TensorEntry:
        """The index entry of the tensor at ``key`` (a key path string, or a tuple of keys)."""
        if isinstance(key, tuple) and key in self._entries:
            return self._entries[key]
        if isinstance(key, str) and key in self._by_key:
            path = self._by_key[key]
            if path is None:
                raise KeyError(f"{self.path}: several tensors have the key path {key!r} (keys that contain dots, "
                               "or an int key and its str twin): pass the path as a tuple of keys")
            return self._entries[path]
        raise KeyError(f"{self.path}: no tensor {key!r}; its tensors are {self.keys()[:8]}"
                       + (" ..." if len(self) > 8 else ""))

    def entries(self) -> list[TensorEntry]:
        return list(self._entries.values())

    @property
    def leaves(self) -> dict[str, Any]:
        """The non-tensor leaves (step, learning rates, RNG seeds, ...) by key path."""
        found: dict[str, Any] = {}
        _scalar_leaves(self.skeleton(), (), found)
        return found

    def skeleton(self) -> Any:
        """The saved state with every tensor replaced by its TensorEntry (nothing is read)."""
        return self.rebuild(lambda entry: entry)

    def rebuild(self, tensor_of: Callable[[TensorEntry], Any]) -> Any:
        """The saved state's containers and non-tensor leaves, with ``tensor_of(entry)`` at each
        tensor leaf."""
        return unflatten(self._structure.tree, lambda path, node: tensor_of(self._entries[path]), self.path)

    # --- reads ----------------------------------------------------------------------------

    def read(self, key: Key, *, device: Device = "cpu", checksum: bool = True) -> torch.Tensor:
        """A new tensor on ``device`` with the tensor at ``key`` (its bytes only are read; a
        view's blob whole, where checksums are verified)."""
        e, dev = self.entry(key), target_device(device)
        if e.view is None:
            out = empty_tensor(e.shape, e.dtype, dev)
            self.stream({e.stored_as: out}, checksum=checksum)
            return out
        blob = torch.empty(e.end - e.offset, dtype=torch.uint8, device=dev)
        self.stream({e.stored_as: blob}, checksum=checksum)
        return make_view(blob, e.view)

    def read_into(self, key: Key, tensor: torch.Tensor, *, checksum: bool = True) -> torch.Tensor:
        """Fill ``tensor`` (same shape and dtype, any device, contiguous or not) in place."""
        e = self.entry(key)
        _check_destination(self.path, e, tensor)
        if e.view is None:
            self.stream({e.stored_as: tensor}, checksum=checksum)
        else:
            with torch.no_grad():
                tensor.copy_(self.read(key, device=tensor.device, checksum=checksum))
        return tensor

    def read_slices(self, requests: Sequence[tuple[Key, Sequence[int], Sequence[int] | None,
                                                   torch.Tensor | Device]], *,
                    checksum: bool = True) -> list[torch.Tensor]:
        """Boxes of stored tensors in one pass over the file: each request ``(key, offsets,
        lengths, into or device)`` names the box of the tensor at ``key`` that starts at
        ``offsets`` (per dimension) and spans ``lengths`` (None, or fewer dimensions: to the
        end), read into ``into`` (of the box's shape and the tensor's dtype, contiguous or not)
        or a new tensor on a device; returns the destinations. Only the bytes of the boxes are
        read (a box of rows is one run of the file, of columns one run per row), so checksums,
        which cover whole tensors, are compared (with ``checksum``) only for a box that is the
        whole tensor. ``get_slice`` reads one box by indexing."""
        outs: list[torch.Tensor] = []
        pieces: list[Piece] = []
        whole: list[tuple[int, str, int]] = []  # (its piece, stored name, CRC) per request to verify
        for key, offsets, lengths, into in requests:
            e = self.entry(key)
            offsets, lengths = normalize_box(e.shape, offsets, lengths, e.key)
            if isinstance(into, torch.Tensor):
                _check_destination(self.path, dataclasses.replace(e, shape=tuple(lengths)), into)
                dst = into
            else:
                dst = empty_tensor(tuple(lengths), e.dtype, target_device(into))
            if e.view is None:
                runs = slice_pieces(dst, e.shape, offsets, e.offset)
                if checksum and e.checksum is not None and len(runs) == 1 and runs[0].nbytes == e.end - e.offset:
                    whole.append((len(pieces), e.stored_as, e.checksum))  # the whole tensor: one piece
                pieces += runs
            else:  # a view's elements are not row-major in the file: through the whole view
                box = self.read(key, device=dst.device, checksum=False)
                with torch.no_grad():
                    dst.copy_(box[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))])
            outs.append(dst)
        crcs = ReadEngine(self._source, pieces, self._cfg, checksum=bool(whole)).run()
        self._compare([(name, crc) for _, name, crc in whole], [crcs[i] for i, _, _ in whole])
        return outs

    def get_slice(self, key: Key, *, device: Device = "cpu") -> TensorSlice:
        """An object that reads boxes of the tensor at ``key`` by indexing, as safetensors'
        ``get_slice``, into new tensors on ``device``: ``reader.get_slice("w")[2:5, :, 0]``.
        Only the bytes of the box are read (see ``read_slices``)."""
        return TensorSlice(self, self.entry(key), target_device(device))

    def load(self, *, device: Device = "cpu", checksum: bool = True, progress: bool = False,
             mmap: bool | None = None) -> Any:
        """The whole state (see ``ckptstream.load``: on the CPU mapped by default); on the
        "meta" device its structure only, with tensors of the right dtypes and shapes and
        nothing read."""
        if mmap:
            _mapped.check_device(as_device(device))
        dev = as_device(device)
        dev = dev if dev.type == "meta" else target_device(dev)

        def build(tensors: dict[str, torch.Tensor]) -> Any:
            views: dict[View, torch.Tensor] = {}  # identical views come back as one tensor object

            def view_leaf(path: KeyPath, node: dict[str, Any]) -> torch.Tensor:
                view = self._structure.views[path]
                if view not in views:
                    views[view] = make_view(tensors[view.base], view)
                return views[view]

            with _gc.paused():
                return rebuild(self._structure.tree, tensors, view_leaf)

        if mmap or (mmap is None and dev.type == "cpu"):
            # by default a storage that cannot map (an object store) gets the copying load
            nthreads = _mapped.threads(self._cfg.io_threads, self._cfg.hot_io_threads)
            mapped, state = _mapped.mapped_load(self.path, self._source, self.header, dev, build, nthreads=nthreads,
                                                compare=self._compare, checksum=checksum, progress=progress,
                                                required=bool(mmap))
            if mapped:
                return state
        if dev.type == "meta":
            return build({t.name: empty_tensor(t.shape, t.dtype, dev) for t in self.header.tensors})
        return build(self._load_tensors(dev, checksum, progress))

    def _load_tensors(self, dev: torch.device, checksum: bool, progress: bool) -> dict[str, torch.Tensor]:
        """Every stored tensor, read into few allocations on ``dev`` (see ``blocks``)."""
        h = self.header
        check = checksum and h.crcs is not None
        with _gc.paused():
            to = blocks.arrange(h.tensors, h.data_start, dev, {v.base for v in self._structure.views.values()})
        crcs = dict(zip((t.name for t in h.tensors), h.crcs, strict=True)) if check else {}  # type: ignore[arg-type]
        got = self._run(to.pieces, check, progress, spans=to.spans)
        self._compare([(name, crcs[name]) for name in to.names] if check else [], got)
        return to.tensors

    def _run(self, pieces: list[Piece], check: bool, progress: bool, *, stream: torch.cuda.Stream | None = None,
             spans: list[tuple[int, int]] | None = None) -> list[int]:
        with progress_bar(progress, sum(p.nbytes for p in pieces), f"load {os.path.basename(self.path)}") as bar:
            with _gc.paused():
                engine = ReadEngine(self._source, pieces, self._cfg, checksum=check, progress=bar, stream=stream,
                                    spans=spans)
            return engine.run()

    def _compare(self, stored: Sequence[tuple[str, int]], got: Sequence[int]) -> None:
        """Raise for the first tensor whose computed CRC-32C is not the stored one."""
        for (name, crc), computed in zip(stored, got, strict=False):  # got is empty without checksums
            if crc != computed:
                raise CorruptCheckpointError(
                    f"{self.path}: {self._keys_of(name)} fails its CRC-32C check (stored {crc:08x}, computed "
                    f"{computed:08x}): its data is corrupt; restore it from another checkpoint or copy")

    def verify(self, *, progress: bool = False) -> None:
        """Read every tensor's bytes and compare them with their checksums (a file without
        checksums is checked for its structure only)."""
        self.stream(dict.fromkeys(t.name for t in self.header.tensors), checksum=True, progress=progress)

    def stream(self, dests: Mapping[str, torch.Tensor | None], *, checksum: bool = True, progress: bool = False,
               stream: torch.cuda.Stream | None = None) -> None:
        """Stream stored tensors (by their table names) into ``dests``' tensors; a name mapped
        to None is read for its checksum only (not read without checksums), names not in
        ``dests`` are skipped. With ``checksum``, compare each with its stored CRC-32C.

        Small tensors into plain contiguous tensors of their dtype and shape are read as a
        whole load reads them: runs of them into scratch memory (see ``blocks``; at most
        ``GATHER_UP_TO`` bytes per device), checksummed there, then moved into their
        destinations once verified: on a GPU with one copy call per device, in host memory
        with one memmove each. Thousands of them cost one piece per run instead of one each,
        and a checksum that fails leaves their destinations untouched."""
        check = checksum and self.header.crcs is not None
        with _gc.paused():
            plan = _plan_stream(self.header, dests, check)
            start = self.header.data_start
            host = blocks.host_scratch(plan.host, plan.host_dests, start)
            runs = {dev: blocks.arrange(infos, start, dev) for dev, infos in plan.gpu.items()}
            # the others one piece each, in file order as plan.stored is (without spans the engine
            # gives one checksum per piece)
            alone = [Piece.of(dst, start + t.begin) for t, dst in host.alone]
            direct = list(heapq.merge(plan.pieces, alone, key=operator.attrgetter("offset"))) if alone else plan.pieces
            pieces = [*host.pieces, *(p for to in runs.values() for p in to.pieces), *direct]
        gathering = bool(runs or host.pieces)  # checksums by span (each piece's, or a run's tensors)
        got = self._run(pieces, check, progress, stream=stream, spans=plan.spans if gathering else None)
        self._compare(plan.stored, got)
        blocks.move_into(host.dests, host.sources)
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for to in runs.values():  # on the stream the engine handed its copies back to
                torch._foreach_copy_([dests[n] for n in to.names], [to.tensors[n] for n in to.names])  # type: ignore[misc]

    def _keys_of(self, stored_as: str) -> str:
        """The user-facing keys of a stored tensor, for messages."""
        keys = [e.key for e in self._entries.values() if e.stored_as == stored_as]
        return f"tensor {keys[0]!r}" if len(keys) == 1 else f"the shared data of tensors {keys[:5]}"

    # --- life -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file; safe to call twice."""
        self._source.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


GATHER_UP_TO = 256 << 20  # scratch bytes per device that ``stream`` may gather small tensors in


@dataclasses.dataclass
class _StreamPlan:
    """What ``stream`` reads, by one pass over the stored tensors in file order: the small ones
    that go through scratch memory (``host``, with their destinations, and ``gpu`` by device),
    the pieces of the others (straight into their destinations, or read for their checksums
    only), and every tensor's span and stored CRC-32C, in file order."""

    host: list[_header.TensorInfo] = dataclasses.field(default_factory=list)
    host_dests: list[torch.Tensor] = dataclasses.field(default_factory=list)
    gpu: dict[torch.device, list[_header.TensorInfo]] = dataclasses.field(default_factory=dict)
    pieces: list[Piece] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    stored: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # empty without checksums


def _plan_stream(header: Header, dests: Mapping[str, torch.Tensor | None], check: bool) -> _StreamPlan:
    """Which way each stored tensor of ``dests`` goes. Small tensors whose destinations a
    scratch run can fill (plain, contiguous, of the stored dtype and shape; in host memory
    without a conjugate or negative bit, as their bytes are moved as they are) are gathered:
    below ``blocks.SMALL`` bytes on a GPU, ``blocks.HOST_SMALL`` in host memory, up to
    ``GATHER_UP_TO`` bytes per device. No bytes: nothing to read or check."""
    plan = _StreamPlan()
    start, crcs = header.data_start, header.crcs
    room: dict[torch.device, int] = {}
    get, plain, small, host_small, strided = dests.get, PLAIN_TENSORS, blocks.SMALL, blocks.HOST_SMALL, torch.strided
    pieces, spans, stored = plan.pieces, plan.spans, plan.stored
    host_room = GATHER_UP_TO
    for i, t in enumerate(header.tensors):
        nbytes = t.end - t.begin
        dst = get(t.name, _SKIP) if nbytes else _SKIP
        if dst is _SKIP or (dst is None and not check):
            continue
        spans.append((start + t.begin, start + t.end))
        if check:
            stored.append((t.name, crcs[i]))  # type: ignore[index]
        if not isinstance(dst, torch.Tensor):  # None: read for its checksum only
            pieces.append(Piece.unread(nbytes, start + t.begin))
            continue
        if (nbytes < small and type(dst) in plain and dst.dtype is t.dtype and dst.is_contiguous()
                and dst.shape == t.shape):
            if dst.is_cpu:
                if (nbytes < host_small and host_room >= nbytes and dst.layout is strided and not dst.is_conj()
                        and not dst.is_neg()):
                    host_room -= nbytes
                    plan.host.append(t)
                    plan.host_dests.append(dst)
                    continue
            elif dst.is_cuda and t.dtype not in BYTE_COPIED:  # dtypes some torch releases cannot copy
                where = dst.device
                left = room.get(where, GATHER_UP_TO) - nbytes
                if left >= 0:
                    room[where] = left
                    plan.gpu.setdefault(where, []).append(t)
                    continue
        pieces.append(Piece.of(dst, start + t.begin))
    return plan


class TensorSlice:
    """``reader.get_slice(key)``: boxes of one tensor by indexing, as torch indexes a tensor:
    ints (negative ones count from the end) and slices of step 1 (their bounds as Python clips
    them: ``[-5:]``, ``[2:-3]``, ``[10:2]`` empty)."""

    def __init__(self, reader: CheckpointReader, entry: TensorEntry, device: torch.device) -> None:
        self._reader, self.entry, self.device = reader, entry, device

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> torch.dtype:
        return self.entry.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        shape = self.entry.shape
        if len(index) > len(shape):
            raise IndexError(f"{self.entry.key}: {len(index)} indices for a tensor of {len(shape)} dimensions")
        offsets, lengths, drop = [], [], []
        for dim, (i, size) in enumerate(zip(index, shape, strict=False)):
            if isinstance(i, slice):
                lo, hi, step = i.indices(size)
                if step != 1:
                    raise IndexError(f"{self.entry.key}: only slices of step 1 can be read, got {i} (step {step}); "
                                     "read the box with step 1, then index the tensor read (flip() for step -1)")
                offsets.append(lo)
                lengths.append(max(0, hi - lo))
            elif isinstance(i, int) and not isinstance(i, bool):  # torch reads True as a new dimension
                j = i + size if i < 0 else i
                if not 0 <= j < size:
                    raise IndexError(f"{self.entry.key}: index {i} is out of range for dimension {dim} of size {size}")
                offsets.append(j)
                lengths.append(1)
                drop.append(dim)
            else:
                raise TypeError(f"{self.entry.key}: index with ints and slices, got {type(i).__name__}")
        box = (self.entry.path, offsets, lengths + list(shape[len(lengths) :]), self.device)
        out = self._reader.read_slices([box])[0]
        for dim in reversed(drop):
            out = out.squeeze(dim)
        return out


def _check_destination(path: str, e: TensorEntry, t: torch.Tensor) -> None:
    check_tensor(t, f"the destination of {e.key!r}", writable=True)
    if (t.dtype, tuple(t.shape)) != (e.dtype, tuple(e.shape)):
        # never reinterpreted nor converted: a read gives the stored values, bit for bit
        hint = "; read() it and convert with .to()" if t.dtype != e.dtype else ""
        raise StateMismatchError(f"{path}: {e.key} is {e.dtype} {list(e.shape)} in the file; the destination is "
                                 f"{t.dtype} {list(t.shape)}{hint}")


def _scalar_leaves(node: Any, path: KeyPath, found: dict[str, Any]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _scalar_leaves(v, (*path, k), found)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _scalar_leaves(v, (*path, i), found)
    elif not isinstance(node, TensorEntry):
        found[key_str(path)] = node
