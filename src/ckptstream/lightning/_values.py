"""Lightning's checkpoint values <-> the values a ckptstream state holds.

A Lightning checkpoint is a dict whose leaves go beyond ckptstream's state rules: hyper-parameters
in an ``AttributeDict`` or an ``argparse.Namespace``, ``pathlib`` paths, ``torch.Size`` and
``torch.dtype`` values, a module's ``state_dict`` with its ``_metadata`` versions, callback states
with arbitrary objects. The policy:

- a subclass of a plain container or scalar (``AttributeDict``, ``OrderedDict`` and ``defaultdict``
  subclasses, namedtuples, ``numpy.float64``, a ``str`` subclass key) is stored as its base type;
- a few types are restored as themselves, recorded in the file's metadata under ``TYPES_KEY``
  (key path, tag): ``AttributeDict``, ``argparse.Namespace`` (stored as dicts), ``pathlib`` paths,
  ``torch.dtype`` and ``torch.device`` (as str), ``torch.Size`` (as a tuple), and the
  ``_metadata`` of a ``state_dict`` (as JSON); every other subclass comes back as its base type;
- a ``bool`` dict key (ckptstream's keys are str or int) is stored as its int, and the dict's
  bool keys recorded under the tag "bool_keys", so that it comes back a ``bool``;
- anything else (dataclasses, enums, sets, bytes, numpy arrays, any other object) is refused with
  its key path and how to make it plain, or, with ``allow_pickle``, pickled into a uint8 tensor
  and tagged "pickle": loading it runs code, so a load unpickles only with ``allow_pickle``.
  An ``IntEnum`` or ``StrEnum`` member is an int or a str too, but stored as one it would come
  back as a plain number or text, which a comparison with the enum's members may still accept
  while ``type(...)``, ``isinstance`` and ``.name`` no longer do: it is refused like any enum. An
  enum member as a dict key is refused with or without ``allow_pickle`` (keys are never pickled).

Nothing here imports by a name read from a file: the tags name a fixed set of constructors.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import functools
import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict

from .._errors import CorruptCheckpointError, UnsupportedTypeError
from .._format.structure import MAX_DEPTH, KeyPath
from . import _pickled

__all__ = ["TYPES_KEY", "TypeTable", "key_path", "restore", "to_plain"]

TYPES_KEY = "lightning.types"  # the user-metadata key of the table of restored types
TABLE_VERSION = 1
_SCALARS = (bool, int, float, str)
_PATHS: dict[str, Callable[[str], pathlib.PurePath]] = {
    "Path": pathlib.Path, "PurePosixPath": pathlib.PurePosixPath, "PureWindowsPath": pathlib.PureWindowsPath}

_AS_IS = frozenset({torch.Tensor, torch.nn.Parameter, *_SCALARS, type(None)})  # stored as they are
TypeTable = list[tuple[KeyPath, str, Any]]  # (key path, tag, payload)


def key_path(path: KeyPath) -> str:
    """``checkpoint['callbacks']['EarlyStopping{...}']['patience']``: Lightning's keys hold dots."""
    return "checkpoint" + "".join(f"[{k!r}]" for k in path)


def to_plain(checkpoint: Any, *, allow_pickle: bool) -> tuple[Any, TypeTable]:
    """A copy of ``checkpoint`` (new containers, the same tensors) that ckptstream stores, and the
    table of what to restore; raises UnsupportedTypeError naming the first refused value."""
    table: TypeTable = []
    return _plain(checkpoint, (), table, allow_pickle), table


def _plain(value: Any, path: KeyPath, table: TypeTable, allow_pickle: bool) -> Any:
    kind = type(value)
    if kind in _SCALARS or value is None or isinstance(value, torch.Tensor):
        return value  # the core checks tensors (and names a refused one by its key path)
    if len(path) > MAX_DEPTH:
        return value  # the core refuses it, with its depth limit (also a state containing itself)
    if isinstance(value, dict):
        return _plain_dict(value, path, table, allow_pickle)
    if isinstance(value, (list, tuple)):
        items = [_plain(v, (*path, i), table, allow_pickle) for i, v in enumerate(value)]
        if isinstance(value, torch.Size):
            table.append((path, "torch.Size", None))
        return items if isinstance(value, list) else tuple(items)
    return _plain_leaf(value, path, table, allow_pickle)


def _plain_leaf(value: Any, path: KeyPath, table: TypeTable, allow_pickle: bool) -> Any:
    """A value that is neither a plain scalar, a tensor, nor a dict, list or tuple."""
    if isinstance(value, enum.Enum):  # before the scalars: an IntEnum is an int
        return _refuse_or_pickle(value, path, table, allow_pickle)
    for base in _SCALARS:
        if isinstance(value, base):  # numpy.float64, a str subclass: its value, as the base type
            return base(value)
    if isinstance(value, argparse.Namespace):
        table.append((path, "Namespace", None))
        return _plain_dict(vars(value), path, table, allow_pickle)
    if isinstance(value, pathlib.PurePath):
        name = "PureWindowsPath" if isinstance(value, pathlib.PureWindowsPath) else (
            "PurePosixPath" if type(value) is pathlib.PurePosixPath else "Path")
        table.append((path, "path", name))
        return str(value)
    if isinstance(value, (torch.dtype, torch.device)):
        table.append((path, f"torch.{type(value).__name__}", None))
        return str(value).removeprefix("torch.")
    return _refuse_or_pickle(value, path, table, allow_pickle)


def _plain_dict(value: dict[Any, Any], path: KeyPath, table: TypeTable, allow_pickle: bool) -> dict[Any, Any]:
    out: dict[Any, Any] = collections.OrderedDict() if isinstance(value, collections.OrderedDict) else {}
    bool_keys: list[int] = []
    for key, item in value.items():
        plain_key = key if type(key) is str else _plain_key(key, path)
        if type(key) is bool:
            bool_keys.append(int(key))
        # the common leaves without a call: a state_dict holds many thousands of tensors
        out[plain_key] = item if type(item) in _AS_IS else _plain(item, (*path, plain_key), table, allow_pickle)
    if len(out) != len(value):  # two keys of different subclasses with one value
        raise UnsupportedTypeError(f"{key_path(path)}: two keys of this dict are equal as their base types "
                                   f"({sorted(map(repr, value))[:6]}); store it with distinct str or int keys")
    if bool_keys:
        table.append((path, "bool_keys", bool_keys))
    if isinstance(value, FabricAttributeDict):
        table.append((path, "AttributeDict", None))
    metadata = getattr(value, "_metadata", None) if type(value) is collections.OrderedDict else None
    if metadata is not None:  # a module's state_dict: its modules' versions, for load_state_dict
        table.append((path, "state_dict_metadata", _json_payload(metadata, path)))
    return out


def _plain_key(key: Any, path: KeyPath) -> str | int:
    """The stored key: a bool as its int (``_plain_dict`` records it), a subclass of str or int
    as its base value; raises UnsupportedTypeError for any other key, an enum member among them."""
    if type(key) in (str, int):
        return key  # type: ignore[no-any-return]
    if type(key) is bool:
        return int(key)
    if isinstance(key, enum.Enum):
        raise UnsupportedTypeError(f"{key_path(path)}: dict key {key!r} is a member of the enum {_type_name(key)}; "
                                   "a checkpoint's dict keys must be str, int or bool, and an enum member stored as "
                                   "its value would come back as a plain str or int: use key.name as the key (and "
                                   f"{type(key).__qualname__}[name] where it is read) in on_save_checkpoint")
    if isinstance(key, (str, int)):
        return str(key) if isinstance(key, str) else int(key)
    raise UnsupportedTypeError(f"{key_path(path)}: dict key {key!r} is a {_type_name(key)}; a checkpoint's dict "
                               "keys must be str, int or bool: convert the key (e.g. str(key)) in on_save_checkpoint")


def _json_payload(metadata: Any, path: KeyPath) -> Any:
    try:
        return json.loads(json.dumps(list(metadata.items()), allow_nan=False))
    except (TypeError, ValueError, AttributeError) as e:
        raise UnsupportedTypeError(f"{key_path(path)}: the state_dict's _metadata is not plain data ({e}); "
                                   "ckptstream stores it as JSON") from e


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _what(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"a {_type_name(value)}"


def _how_to_make_plain(value: Any) -> str:
    if isinstance(value, type):  # Lightning stores type(hparams) beside OmegaConf hyper-parameters
        return "store the class's name, not the class (a class is code)"
    if dataclasses.is_dataclass(value):
        return "store dataclasses.asdict(value) and rebuild the dataclass where it is read"
    if isinstance(value, enum.Enum):
        how = f"store value.name and look the member up where it is read ({type(value).__qualname__}[name])"
        for base in (int, str):  # an IntEnum, IntFlag or StrEnum member: why not as the value it also is
            if isinstance(value, base):
                return f"{how}: stored as the {base.__name__} it also is, it would come back as a plain {base.__name__}"
        return how
    if isinstance(value, (set, frozenset)):
        return "store sorted(value) as a list"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "store torch.frombuffer(bytearray(value), dtype=torch.uint8)"
    package = type(value).__module__.split(".")[0]
    if package == "numpy":
        return "store torch.from_numpy(value) for an array, value.item() for a scalar"
    if package == "omegaconf":
        return "store OmegaConf.to_container(value, resolve=True)"
    return "convert it to dicts, lists, str, numbers and tensors"


def _refuse_or_pickle(value: Any, path: KeyPath, table: TypeTable, allow_pickle: bool) -> Any:
    if allow_pickle:
        try:
            stored = _pickled.dumps(value)
        except Exception as e:  # any error of the object's own __reduce__
            raise UnsupportedTypeError(f"{key_path(path)}: {_what(value)} cannot be pickled ({e})") from e
        table.append((path, "pickle", None))
        return stored
    raise UnsupportedTypeError(
        f"{key_path(path)}: StreamCheckpointIO does not store {_what(value)}: {_how_to_make_plain(value)} "
        "(in the on_save_checkpoint hook of the LightningModule or callback that adds it, and back in "
        "on_load_checkpoint), or pass StreamCheckpointIO(allow_pickle=True) to store such values with pickle "
        "(loading them runs code: only for checkpoints you trust)")


# --- the table in the file's metadata ---------------------------------------------------------


def encode_table(table: TypeTable) -> str:
    return json.dumps({"version": TABLE_VERSION, "values": [[list(p), tag, payload] for p, tag, payload in table]},
                      separators=(",", ":"))


def decode_table(text: str, where: str) -> TypeTable:
    """The table of ``encode_table``, checked: raises CorruptCheckpointError for anything else."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: the metadata {TYPES_KEY!r} is not JSON ({e})") from e
    ok = type(doc) is dict and doc.get("version") == TABLE_VERSION and type(doc.get("values")) is list
    rows = doc["values"] if ok else []
    table: TypeTable = []
    for row in rows:
        if not (type(row) is list and len(row) == 3 and type(row[0]) is list and row[1] in _RESTORE
                and all(type(k) in (str, int) for k in row[0])):
            ok = False
            break
        table.append((tuple(row[0]), row[1], row[2]))
    if not ok:
        raise CorruptCheckpointError(f"{where}: the metadata {TYPES_KEY!r} is not a table of version "
                                     f"{TABLE_VERSION} that this ckptstream writes: {text[:200]!r}")
    return table


# --- restoring ----------------------------------------------------------------------------------


def restore(state: Any, table: TypeTable, *, where: str, unpickle: str | None) -> Any:
    """``state`` as loaded, with the types of ``table`` restored (deepest first, so that a
    container is rebuilt after what it holds). ``unpickle``: None to unpickle tagged values, else
    why not (UnsupportedTypeError names every pickled key path)."""
    pickled = [p for p, tag, _ in table if tag == "pickle"]
    if pickled and unpickle is not None:
        raise UnsupportedTypeError(f"{where} holds values stored with pickle at {[key_path(p) for p in pickled]}: "
                                   f"{unpickle}")
    for path, tag, payload in sorted(table, key=lambda row: -len(row[0])):
        state = _replace(state, path, functools.partial(_restore_one, tag=tag, payload=payload, path=path,
                                                        where=where), where)
    return state


def _replace(state: Any, path: KeyPath, make: Callable[[Any], Any], where: str) -> Any:
    if not path:
        return make(state)
    parent = state
    for key in path[:-1]:
        parent = _child(parent, key, path, where)
    last = path[-1]
    value = make(_child(parent, last, path, where))
    if isinstance(parent, tuple):  # tuples are immutable: rebuild the tuple in its own parent
        i = int(last)  # an int: _child found it in the tuple
        rebuilt = (*parent[:i], value, *parent[i + 1:])
        return _replace(state, path[:-1], lambda _: rebuilt, where)
    parent[last] = value
    return state


def _child(parent: Any, key: Any, path: KeyPath, where: str) -> Any:
    try:
        if isinstance(parent, dict) or (isinstance(parent, (list, tuple)) and type(key) is int and key >= 0):
            return parent[key]
    except (KeyError, IndexError):
        pass
    raise CorruptCheckpointError(f"{where}: the metadata {TYPES_KEY!r} names {key_path(path)}, "
                                 "which is not in the checkpoint")


def _restore_one(value: Any, tag: str, payload: Any, path: KeyPath, where: str) -> Any:
    restored = _RESTORE[tag](value, payload)
    if restored is None:
        raise CorruptCheckpointError(f"{where}: {key_path(path)} is tagged {tag!r} in {TYPES_KEY!r} but holds "
                                     f"{type(value).__name__} {str(value)[:100]!r}")
    return restored


def _attribute_dict(value: Any, payload: Any) -> Any:
    return AttributeDict(value) if isinstance(value, dict) else None


def _namespace(value: Any, payload: Any) -> Any:
    ok = isinstance(value, dict) and all(type(k) is str for k in value)
    return argparse.Namespace(**value) if ok else None


def _state_dict_metadata(value: Any, payload: Any) -> Any:
    if not isinstance(value, collections.OrderedDict) or type(payload) is not list or not all(
            type(p) is list and len(p) == 2 and type(p[0]) is str for p in payload):
        return None
    value._metadata = collections.OrderedDict((k, v) for k, v in payload)  # type: ignore[attr-defined]
    return value


def _bool_keys(value: Any, payload: Any) -> Any:
    """The dict with its int keys 0 and 1 named in ``payload`` as False and True again, in
    their order (in place: a restored type around it stays)."""
    if not (isinstance(value, dict) and type(payload) is list and payload
            and len(set(payload)) == len(payload) == len([k for k in payload if type(k) is int and k in (0, 1)])):
        return None
    items = list(value.items())
    if sum(type(k) is int and k in payload for k, _ in items) != len(payload):
        return None
    value.clear()
    value.update((bool(k) if type(k) is int and k in payload else k, v) for k, v in items)
    return value


def _size(value: Any, payload: Any) -> Any:
    return torch.Size(value) if type(value) is tuple and all(type(v) is int for v in value) else None


def _unpickle(value: Any, payload: Any) -> Any:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        return None
    return _pickled.loads(value)  # restore() refuses it without allow_pickle


def _path(value: Any, payload: Any) -> Any:
    return _PATHS[payload](value) if type(value) is str and payload in _PATHS else None


def _dtype(value: Any, payload: Any) -> Any:
    dtype = getattr(torch, value, None) if type(value) is str else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _device(value: Any, payload: Any) -> Any:
    try:
        return torch.device(value) if type(value) is str else None
    except RuntimeError:
        return None


_RESTORE: dict[str, Callable[[Any, Any], Any]] = {
    "AttributeDict": _attribute_dict, "Namespace": _namespace, "state_dict_metadata": _state_dict_metadata,
    "bool_keys": _bool_keys,
    "torch.Size": _size, "pickle": _unpickle, "path": _path, "torch.dtype": _dtype, "torch.device": _device}
