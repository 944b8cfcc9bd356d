"""Checkpoint files: whole training states to and from one safetensors file.

save:  flatten the state -> header with placeholder checksums -> stream the tensors into a temp
       file beside the target -> rewrite the header with the checksums -> fsync -> rename ->
       fsync the directory.
load:  validate the header and structure -> allocate -> stream -> compare checksums -> rebuild.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from . import _checksum, _fileio
from ._errors import CorruptCheckpointError, UnsupportedTypeError
from ._format import DTYPE_RANK, MAX_HEADER, Header, encode, layout, parse_json, read_header
from ._pipeline import Span, read_spans, write_spans
from ._settings import Settings, resolve
from ._structure import Path, View, flatten, make_view, parse_view, path_str, tensor_leaves, unflatten

PREFIX = "ckptstream."
FORMAT_KEY, FORMAT_VERSION = PREFIX + "format", "1"
STRUCTURE_KEY = PREFIX + "structure"
CRC_KEY = PREFIX + "crc32c"  # 8 hex digits per tensor, in file order
HEADER_CRC_KEY = PREFIX + "header_crc32c"  # of the header bytes as stored, with these 8 digits as "0"s


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, desc: str) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr) as bar:
        yield bar.update


def _user_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str; got {key!r}: {type(value).__name__}")
        if key.startswith(PREFIX):
            raise ValueError(f"metadata key {key!r}: keys starting with {PREFIX!r} are reserved")
    return metadata


def save(state: Any, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
         checksum: bool = True, progress: bool = False, buffer_size: int | None = None,
         num_buffers: int | None = None, direct_io: bool | None = None) -> None:
    """Save a training state to one safetensors file, atomically.

    Args:
        state: nested dict / OrderedDict / list / tuple with tensors (any device and dtype),
            None, bool, int, float and str leaves (``model.state_dict()``,
            ``optimizer.state_dict()``, step, RNG states, ...). A flat ``{str: Tensor}`` keeps
            its keys as the tensor names, so safetensors readers see exactly those tensors.
        path: the file to create or replace. Until the new file is complete and durable the
            old one stays untouched; a reader sees the old or the new file, never a mix.
        metadata: extra ``str -> str`` pairs for the header's ``__metadata__``.
        checksum: store a CRC-32C of every tensor (checked by ``load`` and ``verify``).
        progress: show a progress bar on stderr.
        buffer_size, num_buffers, direct_io: override ``ckptstream.settings`` for this call.

    Raises:
        UnsupportedTypeError: a value that cannot be stored (named by its key path), before
            any file is created.
        TypeError, ValueError: metadata that is not ``str -> str`` or uses the reserved
            ``ckptstream.`` prefix; a header over safetensors' 100 MB limit (before any file).
        OSError: from the OS (a full disk, a missing directory), with the path.

    Example:
        >>> ckptstream.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}, "ckpt.safetensors")
    """
    cfg = resolve(buffer_size=buffer_size, num_buffers=num_buffers, direct_io=direct_io)
    user = _user_metadata(metadata)
    try:
        flat = flatten(state)
        structure = json.dumps(flat.tree, separators=(",", ":"))
    except RecursionError as e:
        raise UnsupportedTypeError("the state is nested too deeply to be stored, or contains itself") from e
    # safetensors' order (by dtype, widest first, then by name): every tensor starts aligned to its
    # element size, and a flat dict gets the very offsets that safetensors.torch.save_file gives it
    records = sorted(flat.records, key=lambda r: (DTYPE_RANK[r.tensor.dtype], r.name))
    infos = layout([(r.name, r.tensor.dtype, tuple(r.tensor.shape)) for r in records])
    meta = {**user, FORMAT_KEY: FORMAT_VERSION, STRUCTURE_KEY: structure}
    if checksum:
        meta[CRC_KEY] = "0" * 8 * len(infos)  # fixed width, filled in once the data is written
        meta[HEADER_CRC_KEY] = "0" * 8
    header = encode(infos, meta)
    if len(header) - 8 > MAX_HEADER:
        raise ValueError(f"the header would be {len(header) - 8} bytes, over the {MAX_HEADER}-byte limit that "
                         "safetensors readers apply: keep large data in tensors, not in str/list leaves or metadata")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(2, "the directory to save into does not exist; create it first", os.path.dirname(path))
    _fileio.remove_stale_temps(path)
    temp = _fileio.temp_path_for(path)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _fileio.os_error(e, "creating the temp file", temp) from e
    ep = _fileio.Endpoint(fd, temp, len(header), owned=True)
    try:
        try:
            _fileio.pwrite_all(fd, memoryview(header), 0, temp)
            spans = [Span.of(r.tensor, len(header) + info.begin) for r, info in zip(records, infos, strict=True)]
            with progress_bar(progress, sum(s.nbytes for s in spans), f"save {os.path.basename(path)}") as bar:
                crcs = write_spans(ep, spans, cfg, checksum=checksum, progress=bar)
            if checksum:  # fill the fixed-width fields in place: the header keeps its length
                final = bytearray(header)
                _fill(final, CRC_KEY, "".join(f"{c:08x}" for c in crcs))
                _fill(final, HEADER_CRC_KEY, f"{_checksum.crc_of(final):08x}")  # of the bytes with its "0"s
                _fileio.pwrite_all(fd, memoryview(final), 0, temp)
            _fileio.fsync(fd, temp)
        finally:
            ep.close()
        _fileio.publish(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _field(header: bytes | bytearray, key: str) -> int:
    """Offset of the value of metadata field ``key`` in an encoded header, or -1. (Keys inside
    the structure string are escaped, so only the field itself matches.)"""
    tag = f'"{key}":"'.encode()
    at = header.find(tag)
    return at + len(tag) if at >= 0 else -1


def _fill(header: bytearray, key: str, value: str) -> None:
    at = _field(header, key)
    assert at >= 0 and header[at : at + len(value)] == b"0" * len(value), f"no placeholder for {key}"
    header[at : at + len(value)] = value.encode()


@dataclasses.dataclass
class Checkpoint:
    """An open, validated checkpoint file: header, structure and stored checksums."""

    path: str
    fd: int
    header: Header
    tree: Any
    leaves: dict[Path, dict[str, Any]]  # tensor leaves of the tree by key path
    views: dict[Path, View]
    crcs: list[int] | None  # stored CRC-32C per tensor in file order, if any

    def spans(self, tensors: Mapping[str, torch.Tensor | None]) -> list[Span]:
        return [Span(tensors.get(t.name), self.header.data_start + t.begin, t.nbytes) for t in self.header.tensors]

    def read(self, tensors: Mapping[str, torch.Tensor | None], cfg: Settings, verify: bool, progress: bool) -> None:
        """Stream the data section into ``tensors`` (by name); compare checksums if asked."""
        spans = self.spans(tensors)
        check = verify and self.crcs is not None
        ep = _fileio.Endpoint(self.fd, self.path, self.header.data_start)
        try:
            with progress_bar(progress, sum(s.nbytes for s in spans), f"load {os.path.basename(self.path)}") as bar:
                got = read_spans(ep, spans, cfg, checksum=check, progress=bar)
        finally:
            ep.close()  # the O_DIRECT twin, if one was opened; the fd stays with the Checkpoint
        if check:
            assert self.crcs is not None
            for info, stored, computed in zip(self.header.tensors, self.crcs, got, strict=True):
                if stored != computed:
                    raise CorruptCheckpointError(
                        f"{self.path}: tensor {info.name!r} fails its CRC-32C check (stored {stored:08x}, computed "
                        f"{computed:08x}): its data is corrupt; restore it from another checkpoint or copy"
                    )


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[Checkpoint]:
    """Open and validate a checkpoint (ours or any safetensors file) before any device work."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _fileio.os_error(e, "opening the checkpoint", path) from e
    try:
        header = read_header(fd, path)
        yield _parse(path, fd, header)
    finally:
        os.close(fd)


def _parse(path: str, fd: int, header: Header) -> Checkpoint:
    meta = header.metadata
    if meta.get(FORMAT_KEY, FORMAT_VERSION) != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: written in ckptstream format {meta[FORMAT_KEY]!r}; this version reads "
                                     f"format {FORMAT_VERSION!r} (a newer ckptstream may read it)")  # fmt: skip
    names = [t.name for t in header.tensors]
    if STRUCTURE_KEY in meta:
        try:
            tree = parse_json(meta[STRUCTURE_KEY])
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{path}: the {STRUCTURE_KEY} metadata is not valid JSON ({e})") from e
    else:  # a plain safetensors file: a flat dict in file order
        tree = {"dict": [[n, {"tensor": n}] for n in names]}
    try:
        leaves = tensor_leaves(tree, path)
    except RecursionError as e:  # Python 3.13 parses JSON nested deeper than its own recursion limit
        raise CorruptCheckpointError(f"{path}: the {STRUCTURE_KEY} metadata is nested too deeply") from e
    sizes = {t.name: t.nbytes for t in header.tensors}
    used: set[str] = set()
    views: dict[Path, View] = {}
    for leaf, node in leaves.items():
        if "view" in node:
            views[leaf] = parse_view(node, sizes, path)
            used.add(views[leaf].base)
        elif isinstance(node["tensor"], str) and node["tensor"] in sizes:
            used.add(node["tensor"])
        else:
            raise CorruptCheckpointError(f"{path}: {path_str(leaf)} names tensor {node['tensor']!r}, "
                                         "which is not in the tensor table")  # fmt: skip
    unused = [n for n in names if n not in used]
    if unused:
        raise CorruptCheckpointError(f"{path}: tensors {unused[:5]} are in the table but not in the structure")
    crcs = None
    if CRC_KEY in meta:
        text = meta[CRC_KEY]
        if len(text) != 8 * len(names) or any(c not in "0123456789abcdef" for c in text):
            raise CorruptCheckpointError(f"{path}: {CRC_KEY} must be {8 * len(names)} lowercase hex digits "
                                         f"({len(names)} tensors), got {text!r:.100}")  # fmt: skip
        crcs = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
    if crcs is not None or HEADER_CRC_KEY in meta:
        _check_header(path, fd, header)
    return Checkpoint(path, fd, header, tree, leaves, views, crcs)


def _check_header(path: str, fd: int, header: Header) -> None:
    """Compare the header with its own CRC-32C, which covers the tensor table, the structure (keys
    and non-tensor leaves), the metadata and the tensors' checksums: none of them is covered by the
    tensors' checksums, so without it a damaged header could load as a different state."""
    stored = header.metadata.get(HEADER_CRC_KEY)
    if stored is None:
        raise CorruptCheckpointError(f"{path}: the header has tensor checksums but no {HEADER_CRC_KEY}; it is corrupt")
    raw = bytearray(header.data_start)
    _fileio.pread_into(fd, memoryview(raw), 0, path)
    at = _field(raw, HEADER_CRC_KEY)
    if (len(stored) != 8 or any(c not in "0123456789abcdef" for c in stored) or at < 0
            or raw[at : at + 8] != stored.encode()):  # fmt: skip
        raise CorruptCheckpointError(f"{path}: {HEADER_CRC_KEY} must be 8 lowercase hex digits, got {stored!r:.40}")
    raw[at : at + 8] = b"0" * 8
    computed = _checksum.crc_of(raw)
    if computed != int(stored, 16):
        raise CorruptCheckpointError(
            f"{path}: the header fails its CRC-32C check (stored {stored}, computed {computed:08x}): its tensor "
            "table, structure or metadata is corrupt; restore it from another checkpoint or copy"
        )


def _device(device: str | int | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load(path: str | os.PathLike[str], *, device: str | int | torch.device = "cpu", verify: bool = True,
         progress: bool = False, buffer_size: int | None = None, num_buffers: int | None = None) -> Any:
    """Load a state saved by ``save`` (or any safetensors file, as a flat dict).

    Args:
        path: the checkpoint file.
        device: where every tensor lands ("cpu", "cuda", "cuda:1", a torch.device).
        verify: compare every tensor with its stored CRC-32C.
        progress: show a progress bar on stderr.
        buffer_size, num_buffers: override ``ckptstream.settings`` for this call.

    Returns:
        The state with its container types, key order, key types and leaves; tensors that
        shared storage when saved share it again.

    Raises:
        CorruptCheckpointError: the file is malformed, truncated or fails a checksum (named).

    Example:
        >>> state = ckptstream.load("ckpt.safetensors", device="cuda")
    """
    cfg = resolve(buffer_size=buffer_size, num_buffers=num_buffers)
    dev = _device(device)
    with open_checkpoint(path) as ck:
        tensors = {t.name: torch.empty(t.shape, dtype=t.dtype, device=dev) for t in ck.header.tensors}
        ck.read(tensors, cfg, verify, progress)

        views: dict[View, torch.Tensor] = {}  # identical views come back as one tensor object

        def resolve_leaf(leaf: Path, node: dict[str, Any]) -> torch.Tensor:
            if leaf in ck.views:
                view = ck.views[leaf]
                if view not in views:
                    views[view] = make_view(tensors[view.base], view)
                return views[view]
            return tensors[node["tensor"]]

        return unflatten(ck.tree, resolve_leaf, ck.path)


def verify(path: str | os.PathLike[str]) -> None:
    """Check a checkpoint without loading it: header, structure, length, and every checksum.

    Raises:
        CorruptCheckpointError: naming what is wrong (and which tensor, for a checksum).
    """
    with open_checkpoint(path) as ck:
        ck.read({}, resolve(), verify=True, progress=False)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The user's metadata of a checkpoint (without ckptstream's own keys)."""
    with open_checkpoint(path) as ck:
        return {k: v for k, v in ck.header.metadata.items() if not k.startswith(PREFIX)}
