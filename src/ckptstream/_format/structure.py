"""State trees <-> a flat tensor table plus a JSON description of everything else.

The JSON (stored in the header's metadata) is plain data, never code: containers are tagged
objects, scalars are JSON values, and each tensor leaf names a row of the tensor table.

    {"dict": [[key, node], ...]}   {"odict": [...]}   {"list": [...]}   {"tuple": [...]}
    {"tensor": name}                                  a tensor stored under ``name``
    {"view": [base, dtype, shape, stride, offset]}    a view into the bytes of tensor ``base``
    {"float": "nan" | "inf" | "-inf"}                 non-finite floats (JSON has none)
    null, true/false, 12, 1.5, "text"                 the other leaves

This module holds the format's names and loading's half (parse and check a stored structure,
rebuild the state); ``flatten`` holds saving's half.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from .._errors import CorruptCheckpointError
from .header import DTYPES, element_count, parse_json

Key = str | int
KeyPath = tuple[Key, ...]
VIEW_RATIO, VIEW_FLOOR = 1024, 1 << 20  # see view_limit
INT_BITS = 14_000  # at most 4215 digits: within Python's 4300-digit limit on reading ints from text
SAME_HASH = 8  # more int keys of one dict with one hash value: a crafted file (see unflatten)
MAX_DEPTH = 64  # containers in containers; deeper states are refused (a node's key path costs its depth)


def key_str(path: KeyPath) -> str:
    return ".".join(str(k) for k in path) if path else "<root>"


def view_limit(blob_nbytes: int) -> int:
    """The most bytes a view may describe over a blob of ``blob_nbytes`` (expanded views repeat
    elements): more, and a file is taken as crafted; a save stores such a view as its own bytes."""
    return max(VIEW_FLOOR, VIEW_RATIO * blob_nbytes)


TensorLeaf = Callable[[KeyPath, dict[str, Any]], Any]


def _check_int_keys(pairs: list[tuple[Key, Any]], where: str, path: KeyPath) -> None:
    """Reject a dict whose int keys share a hash value too often: Python's dicts take quadratic
    time over such keys (k * (2**61 - 1) all hash alike), which only a crafted file holds."""
    if len(pairs) <= SAME_HASH:
        return
    counts = collections.Counter(hash(k) for k, _ in pairs if type(k) is int)  # ints hash to themselves
    if counts and max(counts.values()) > SAME_HASH:
        raise CorruptCheckpointError(f"{where}: the dict at {key_str(path)} has more than {SAME_HASH} int keys with "
                                     "one hash value: the file is crafted to make loading slow")


def unflatten(tree: Any, tensor_leaf: TensorLeaf, where: str, path: KeyPath = ()) -> Any:
    """Rebuild a state from its JSON tree; ``tensor_leaf(path, node)`` gives each tensor leaf.
    (Written for speed: a file may hold hundreds of thousands of nodes.)"""
    kind = type(tree)
    if kind is not dict:
        if tree is None or kind in _SCALARS:
            return tree
        raise CorruptCheckpointError(f"{where}: unexpected {kind.__name__} in the structure at {key_str(path)}")
    if len(tree) != 1:
        raise CorruptCheckpointError(f"{where}: structure node at {key_str(path)} has keys {sorted(tree)!r:.200}")
    tag, body = next(iter(tree.items()))
    if tag == "tensor" or tag == "view":
        return tensor_leaf(path, tree)
    if type(body) is list:
        if len(path) >= MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: the structure nests containers more than {MAX_DEPTH} deep, "
                                         "deeper than ckptstream writes: the file is crafted or corrupt")
        if tag == "dict" or tag == "odict":
            return _unflatten_dict(tag, body, tensor_leaf, where, path)
        if tag == "list" or tag == "tuple":
            items = [unflatten(v, tensor_leaf, where, (*path, i)) for i, v in enumerate(body)]
            return items if tag == "list" else tuple(items)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    raise CorruptCheckpointError(f"{where}: unknown structure node {str(tag)!r:.100} at {key_str(path)}")


_SCALARS = (bool, int, float, str)


def _unflatten_dict(tag: str, body: list[Any], tensor_leaf: TensorLeaf, where: str, path: KeyPath) -> Any:
    pairs = []
    for item in body:
        if type(item) is not list or len(item) != 2 or type(item[0]) not in (str, int):
            raise CorruptCheckpointError(f"{where}: bad dict entry at {key_str(path)}")
        key, node = item
        if type(node) is dict and len(node) == 1 and "tensor" in node:  # the common leaf, without a call
            pairs.append((key, tensor_leaf((*path, key), node)))
        else:
            pairs.append((key, unflatten(node, tensor_leaf, where, (*path, key))))
    _check_int_keys(pairs, where, path)
    mapping = dict(pairs) if tag == "dict" else collections.OrderedDict(pairs)
    if len(mapping) != len(pairs):
        raise CorruptCheckpointError(f"{where}: duplicate key in the dict at {key_str(path)}")
    return mapping


def rebuild(tree: Any, tensors: dict[str, Any], view_leaf: TensorLeaf, path: KeyPath = ()) -> Any:
    """``unflatten`` of a tree that ``parse_structure`` accepted (so every check already passed),
    with its tensor leaves from ``tensors`` by name and its view leaves from ``view_leaf``: one
    dict lookup per tensor leaf, no call."""
    if type(tree) is not dict:
        return tree
    ((tag, body),) = tree.items()
    if tag == "tensor":
        return tensors[body]
    if tag == "view":
        return view_leaf(path, tree)
    if tag == "dict" or tag == "odict":
        out = {} if tag == "dict" else collections.OrderedDict()
        for key, node in body:
            leaf = node.get("tensor") if type(node) is dict else None
            out[key] = tensors[leaf] if leaf is not None else rebuild(node, tensors, view_leaf, (*path, key))
        return out
    if tag == "list" or tag == "tuple":
        items = [rebuild(v, tensors, view_leaf, (*path, i)) for i, v in enumerate(body)]
        return items if tag == "list" else tuple(items)
    return float(body)  # {"float": "nan" | "inf" | "-inf"}


@dataclasses.dataclass(frozen=True)
class Structure:
    """A checkpoint's state as stored: its JSON tree, and each tensor leaf by key path, stored
    either as a tensor of the table (by name) or as a view into one's bytes."""

    tree: Any
    paths: list[KeyPath]  # every tensor leaf, in the state's order
    tensors: dict[KeyPath, str]  # leaf -> tensor name, for leaves stored as a whole tensor
    views: dict[KeyPath, View]  # leaf -> view, for leaves stored as views of shared bytes


def parse_structure(structure: str | None, table: dict[str, int], where: str) -> Structure:
    """The structure of a checkpoint whose tensor table maps names to byte sizes (``table``, in
    file order), validated against it; a plain safetensors file (``structure`` None) is a flat
    dict of its tensors in file order."""
    if structure is None:
        tree: Any = {"dict": [[n, {"tensor": n}] for n in table]}
    else:
        try:
            tree = parse_json(structure)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: the structure metadata is not valid JSON ({e})") from e
    nodes: dict[KeyPath, dict[str, Any]] = {}

    def collect(path: KeyPath, node: dict[str, Any]) -> None:
        nodes[path] = node

    try:
        unflatten(tree, collect, where)
    except RecursionError as e:  # Python 3.13 parses JSON nested deeper than its own recursion limit
        raise CorruptCheckpointError(f"{where}: the structure metadata is nested too deeply") from e
    tensors, views, used = {}, {}, set()
    for leaf, node in nodes.items():
        if "view" in node:
            views[leaf] = parse_view(node, table, f"{where}: {key_str(leaf)!r}")
            used.add(views[leaf].base)
        elif isinstance(node["tensor"], str) and node["tensor"] in table:
            tensors[leaf] = node["tensor"]
            used.add(node["tensor"])
        else:
            raise CorruptCheckpointError(f"{where}: {key_str(leaf)} names tensor {node['tensor']!r}, "
                                         "which is not in the tensor table")  # fmt: skip
    unused = [n for n in table if n not in used]
    if unused:
        raise CorruptCheckpointError(f"{where}: tensors {unused[:5]} are in the table but not in the structure")
    return Structure(tree, list(nodes), tensors, views)


@dataclasses.dataclass(frozen=True)
class View:
    base: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes into the base


def parse_view(node: dict[str, Any], base_nbytes: dict[str, int], where: str) -> View:
    """Validate a view node against the tensor table (bounds, alignment) before any allocation."""
    body = node["view"]
    ok = isinstance(body, list) and len(body) == 5
    if ok:
        base, dtype, shape, stride, offset = body
        ok = (isinstance(base, str) and base in base_nbytes and isinstance(dtype, str) and dtype in DTYPES
              and isinstance(shape, list) and isinstance(stride, list)
              and len(shape) == len(stride)
              and all(type(v) is int and v >= 0 for v in [*shape, *stride, offset]))  # fmt: skip
    if ok:
        ok = max([*stride, offset]) < 2**63 and element_count(shape) is not None  # what torch can hold
    if not ok:
        raise CorruptCheckpointError(f"{where}: malformed view {body!r:.200}")
    view = View(base, DTYPES[dtype], tuple(shape), tuple(stride), offset)
    esz = view.dtype.itemsize
    extent = (sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) + 1) * esz if all(shape) else 0
    if offset % esz or offset + extent > base_nbytes[base]:
        raise CorruptCheckpointError(f"{where}: view of {base!r} at byte {offset} ({extent} bytes) does not fit "
                                     f"its {base_nbytes[base]} bytes")  # fmt: skip
    described = math.prod(view.shape) * esz
    if described > view_limit(base_nbytes[base]):
        raise CorruptCheckpointError(f"{where}: a view of shape {list(view.shape)} describes {described} bytes over "
                                     f"the {base_nbytes[base]} bytes of {base!r}, past the limit of "
                                     f"{view_limit(base_nbytes[base])}: the file is crafted or corrupt")  # fmt: skip
    return view


def make_view(base: torch.Tensor, view: View) -> torch.Tensor:
    storage_offset = (base.storage_offset() * base.element_size() + view.offset) // view.dtype.itemsize
    return torch.empty(0, dtype=view.dtype, device=base.device).set_(
        base.untyped_storage(), storage_offset, view.shape, view.stride
    )
