"""Saving's half of the state tree <-> tensor table mapping (``structure`` has the format and
loading's half): walk a state, check every leaf, and flatten it into tensor records and the
JSON tree that describes everything else; tensors that share memory are stored once, or as
views into one blob of their storage's bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._engine import PLAIN_TENSORS, streamable
from .._errors import UnsupportedTypeError
from .header import DTYPE_NAMES, unnamed_hint
from .structure import INT_BITS, MAX_DEPTH, KeyPath, key_str, view_limit

_CONTAINERS: dict[type, str] = {dict: "dict", collections.OrderedDict: "odict", list: "list", tuple: "tuple"}


def walk(state: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Every leaf with its key path; raises UnsupportedTypeError on anything not storable."""
    kind = _CONTAINERS.get(type(state))
    if kind:
        _check_depth(path)
    if kind in ("dict", "odict"):
        for key, value in state.items():
            _check_dict_key(key, path)
            yield from walk(value, (*path, key))
    elif kind:
        for i, value in enumerate(state):
            yield from walk(value, (*path, i))
    else:
        _check_leaf(state, path)
        yield path, state


def _check_depth(path: KeyPath) -> None:
    """Raises UnsupportedTypeError for a container at ``path`` nested past MAX_DEPTH."""
    if len(path) >= MAX_DEPTH:
        raise UnsupportedTypeError(f"{key_str(path)[:200]}: the state nests containers more than {MAX_DEPTH} deep; "
                                   "ckptstream stores states up to that depth (or the state contains itself)")


def _check_leaf(value: Any, path: KeyPath) -> None:
    """Raises UnsupportedTypeError unless ``value`` (not a container) is a storable leaf."""
    if value is None or type(value) in (bool, int, float, str):
        if type(value) is str:
            _check_text(value, path)
        elif type(value) is int and value.bit_length() > INT_BITS:
            _too_long(value, key_str(path))
    elif isinstance(value, torch.Tensor):
        _check_leaf_tensor(path, value)
    elif isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        what = "module" if isinstance(value, torch.nn.Module) else "optimizer"
        raise UnsupportedTypeError(
            f"{key_str(path)}: cannot store a {type(value).__module__}.{type(value).__qualname__}, a torch {what}: "
            f"pass {what}.state_dict() instead, its tensors and values (e.g. {{'model': model.state_dict(), "
            "'optim': optimizer.state_dict()}), which load_state_dict() takes back")
    else:
        raise UnsupportedTypeError(
            f"{key_str(path)}: cannot store a {type(value).__module__}.{type(value).__qualname__}; a state may hold "
            "dict, OrderedDict, list, tuple, torch.Tensor, None, bool, int, float and str (convert it first, "
            "e.g. int(x) for a numpy integer)"
        )


def _check_dict_key(key: Any, path: KeyPath) -> None:
    """Raises UnsupportedTypeError unless ``key`` (of the dict at ``path``) is a storable str or int."""
    if type(key) not in (str, int):
        raise UnsupportedTypeError(f"{key_str(path)}: dict key {key!r} is a {type(key).__name__}; "
                                   "only str and int keys can be stored")  # fmt: skip
    if type(key) is str:
        _check_text(key, (*path, key))
    elif key.bit_length() > INT_BITS:
        _too_long(key, f"{key_str(path)}: a dict key")  # not printable: the limit applies to str() too


def _too_long(number: int, where: str) -> None:
    raise UnsupportedTypeError(f"{where}: an int of {number.bit_length()} bits is too long for the JSON structure "
                               "(Python reads back at most 4300 digits); store it as a str or a tensor")


def _check_text(text: str, path: KeyPath) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: JSON files are UTF-8
        raise UnsupportedTypeError(f"{key_str(path)!r}: the key or text holds a character that UTF-8 cannot encode "
                                   f"({e.reason} at {e.start}); store it as valid Unicode") from e


_WHOLE_BYTE_DTYPES = frozenset(d for d, name in DTYPE_NAMES.items() if name != "F4")  # F4: see below


def _plainly_storable(t: torch.Tensor) -> bool:
    """The common tensor leaf, in a few attribute reads (a state may hold many thousands): a
    plain dense CPU or CUDA tensor of a whole-byte safetensors dtype, which every check of
    ``_check_leaf_tensor`` accepts."""
    return (type(t) in PLAIN_TENSORS and not t.is_nested and t.dtype in _WHOLE_BYTE_DTYPES
            and t.layout is torch.strided and (t.is_cpu or t.is_cuda) and not t.is_quantized)


def _check_leaf_tensor(path: KeyPath, t: torch.Tensor) -> None:
    if _plainly_storable(t):
        return
    where = key_str(path)
    if t.is_nested:  # strided, or jagged (a subclass): either way, its components are what to store
        raise UnsupportedTypeError(f"{where}: a nested tensor cannot be stored; store its components "
                                   "(t.unbind()) or t.to_padded_tensor(0)")  # fmt: skip
    if type(t) not in PLAIN_TENSORS:
        if type(t).__name__ == "DTensor":
            raise UnsupportedTypeError(f"{where}: a DTensor (sharded or replicated over ranks) is saved through "
                                       "torch.distributed.checkpoint with ckptstream.dcp.StreamWriter, which keeps its "
                                       "placement; see docs/dcp.md")  # fmt: skip
        raise UnsupportedTypeError(f"{where}: tensor subclass {type(t).__name__} is not supported; store the plain "
                                   "tensor it holds (for a wrapper, its .to_local() or inner tensor; else "
                                   "torch.Tensor(t) or t.as_subclass(torch.Tensor))")  # fmt: skip
    if t.is_quantized:
        raise UnsupportedTypeError(f"{where}: a quantized tensor cannot be stored; store t.int_repr() with its "
                                   "scale and zero point, or t.dequantize()")  # fmt: skip
    if not streamable(t):
        raise UnsupportedTypeError(f"{where}: a {t.layout} tensor on {t.device} cannot be stored; only dense "
                                   "(strided) CPU and CUDA tensors (for a sparse one: t.to_dense())")  # fmt: skip
    if t.dtype not in DTYPE_NAMES:
        raise UnsupportedTypeError(f"{where}: dtype {t.dtype} has no safetensors name{unnamed_hint(t.dtype)}; "
                                   f"supported: {sorted(str(d) for d in DTYPE_NAMES)}")  # fmt: skip
    if t.dim() == 0 and DTYPE_NAMES[t.dtype] == "F4":
        raise UnsupportedTypeError(f"{where}: a 0-d {t.dtype} tensor has no safetensors shape; store t.reshape(1)")


@dataclasses.dataclass(slots=True)
class Record:
    """One row of the tensor table: a name and the tensor whose logical bytes it holds."""

    name: str
    tensor: torch.Tensor
    paths: list[KeyPath]  # leaves stored as this tensor (more than one: the same tensor repeated)


@dataclasses.dataclass
class FlatState:
    tree: Any  # JSON-able
    records: list[Record]


# A tensor leaf as flatten meets it: (key path, the name it asks for in the table, the tensor,
# its node of the JSON tree, left empty until the table says how the tensor is stored). A plain
# tuple: a state may hold hundreds of thousands of them.
Leaf = tuple[KeyPath, str, torch.Tensor, dict[str, Any]]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range of ``t`` within its storage."""
    esz = t.element_size()
    start = int(t.storage_offset())
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return start * esz, (start + last + 1) * esz


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def flatten(state: Any) -> FlatState:
    """Split ``state`` into the tensor table and the JSON tree (raises before any I/O)."""
    leaves: list[Leaf] = []
    tree = _node(state, (), "tensor", leaves)
    _resolve_lazy(leaves)
    names: dict[str, int] = {"__metadata__": 0}  # the header's own key is not a tensor name
    records: list[Record] = []

    def add_record(base: str, t: torch.Tensor, paths: list[KeyPath]) -> Record:
        name = base
        if base in names:  # keys like "a.b" and ("a", "b") would collide
            n = names[base]
            while name in names:
                n += 1
                name = f"{base}~{n}"
            names[base] = n
        names.setdefault(name, 0)
        record = Record(name, t, paths)
        records.append(record)
        return record

    # a flat {str: tensor} state keeps every key a tensor name of the file (safetensors readers)
    flat = type(state) in (dict, collections.OrderedDict) and all(len(leaf[0]) == 1 for leaf in leaves)
    for group in _by_storage(leaves):
        for component in _overlapping(group):
            _share(component, add_record, flat)
    for path, name, t, node in leaves:
        if not node:  # not stored by _share
            node["tensor"] = add_record(name, t, [path]).name
    return FlatState(tree, records)


def _node(value: Any, path: KeyPath, name: str, leaves: list[Leaf]) -> Any:
    """The JSON node of ``value`` at ``path``, checked as ``walk`` checks it (the same errors,
    in the same order); a tensor leaf gets an empty node and joins ``leaves``, asking for
    ``name`` (its key path joined by dots). (Written for speed: the plain tensor leaf costs a
    few attribute reads, a dict's str keys an ASCII test.)"""
    if type(value) in PLAIN_TENSORS and _plainly_storable(value):  # the type first: no call for other nodes
        node: dict[str, Any] = {}
        leaves.append((path, name, value, node))
        return node
    kind = _CONTAINERS.get(type(value))
    if kind is None:
        _check_leaf(value, path)
        if isinstance(value, torch.Tensor):
            node = {}
            leaves.append((path, name, value, node))
            return node
        if type(value) is float and not math.isfinite(value):
            return {"float": repr(value)}
        return value
    _check_depth(path)
    prefix = name + "." if path else ""
    if kind == "dict" or kind == "odict":
        items = []
        for key, item in value.items():
            if type(key) is not str or not key.isascii():  # ASCII text always encodes
                _check_dict_key(key, path)
            items.append([key, _node(item, (*path, key), prefix + str(key), leaves)])
        return {kind: items}
    return {kind: [_node(item, (*path, i), prefix + str(i), leaves) for i, item in enumerate(value)]}


def _resolve_lazy(leaves: list[Leaf]) -> None:
    """Replace each lazy conjugate/negative view (z.conj(), z.conj().imag) by a resolved copy,
    one per tensor: its storage does not hold its values, so it is stored as the copy, and not
    as a view of the shared storage."""
    resolved: dict[int, torch.Tensor] = {}
    for i, (path, name, t, node) in enumerate(leaves):
        if t.is_conj() or t.is_neg():
            if id(t) not in resolved:
                resolved[id(t)] = t.resolve_conj().resolve_neg()
            leaves[i] = (path, name, resolved[id(t)], node)


def _by_storage(leaves: list[Leaf]) -> list[list[Leaf]]:
    """The leaves with elements that share a storage with another leaf, by storage, in order."""
    by_storage: dict[tuple[torch.device, int], list[Leaf]] = {}
    for leaf in leaves:
        t = leaf[2]
        if t.numel():
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(leaf)
    return [group for group in by_storage.values() if len(group) > 1]


def _overlapping(group: list[Leaf]) -> list[list[Leaf]]:
    """Leaves of one storage, in components whose byte ranges overlap (sorted sweep)."""
    items = sorted(group, key=lambda leaf: _extent(leaf[2]))
    components: list[list[Leaf]] = []
    end = -1
    for leaf in items:
        lo, hi = _extent(leaf[2])
        if lo >= end:
            components.append([])
        components[-1].append(leaf)
        end = max(end, hi)
    return [c for c in components if len(c) > 1]


def _share(component: list[Leaf], add_record: Callable[[str, torch.Tensor, list[KeyPath]], Record],
           flat: bool) -> None:
    """Store overlapping leaves of one storage: identical ones once (the others as aliases of
    its record); different ones as views into one blob of the storage's bytes, which restores
    their sharing on load; or, in a flat state (whose keys must stay tensor names) and for views
    past ``view_limit``, each as its own bytes."""
    distinct: dict[tuple[Any, ...], list[Leaf]] = {}
    for leaf in component:
        distinct.setdefault(_signature(leaf[2]), []).append(leaf)
    viewed = [] if flat or len(distinct) == 1 else list(distinct.values())
    while len(viewed) > 1:  # the limit is the blob's, as a load checks it; a smaller blob may drop more
        lo, hi = _blob_range([leaf for same in viewed for leaf in same])
        within = [same for same in viewed if same[0][2].numel() * same[0][2].element_size() <= view_limit(hi - lo)]
        if len(within) == len(viewed):
            break
        viewed = within
    if len(viewed) < 2:
        viewed = []
    for same in distinct.values():
        if not any(same is v for v in viewed):
            _, name, t, _ = same[0]
            record = add_record(name, t, [leaf[0] for leaf in same])
            for leaf in same:
                leaf[3]["tensor"] = record.name
    if not viewed:
        return
    leaves = [leaf for same in viewed for leaf in same]
    lo, hi = _blob_range(leaves)
    first_path, first_name, first, _ = leaves[0]
    blob = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage(), lo, (hi - lo,), (1,))
    # raw storage bytes, not a leaf of its own
    base = add_record(first_name + ".__storage__" if first_path else "tensor", blob, [])
    for _, _, t, node in leaves:
        node["view"] = [base.name, DTYPE_NAMES[t.dtype], list(t.shape), list(t.stride()), _extent(t)[0] - lo]


def _blob_range(leaves: list[Leaf]) -> tuple[int, int]:
    """The bytes of their storage that a blob of ``leaves`` holds."""
    lo = min(_extent(leaf[2])[0] for leaf in leaves) // 16 * 16  # 16: any element size divides it
    return lo, max(_extent(leaf[2])[1] for leaf in leaves)
