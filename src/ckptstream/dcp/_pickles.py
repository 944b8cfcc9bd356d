"""The pickles of a DCP checkpoint, read without running code from them.

DCP stores two kinds of pickle: its ``.metadata`` (``Metadata`` and the dataclasses it holds)
and every non-tensor value of the state (``torch.save`` bytes, which DCP's planner unpickles
with ``weights_only=False``). Both are read here by ``SafeUnpickler``, which builds only what an
``Allowed`` table names, exactly, by ``(module, qualified name)``:

- ``classes``: dataclasses, made by NEWOBJ (``cls.__new__(cls)``) and filled by BUILD with a
  dict of fields (or the class's own ``__setstate__``);
- ``calls``: small functions of this package that turn plain arguments into a value (a
  ``torch.Size``, a layout from its name, a ``set``), each checking its arguments;
- ``values``: objects used as they are (dtypes, memory formats).

Nothing is ever imported or looked up by a name from the file, and every opcode that would call
a method of an object on the stack is limited to the types that method belongs to (APPEND to
lists, SETITEM to dicts, BUILD to the classes above), so no module, function or builtin can be
reached. Tuples nest at most ``MAX_DEPTH`` deep: hashing a deeper one (a dict key) overflows
the C stack, in this unpickler as in pickle's and torch's own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import pickle
import zipfile
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from .._errors import CorruptCheckpointError

MAX_DEPTH = 64  # DCP's metadata nests tuples 3 deep (a key's torch.Size offsets)


@dataclasses.dataclass(frozen=True)
class Allowed:
    """What one kind of pickle may hold, each name mapped to the object it stands for."""

    classes: Mapping[tuple[str, str], type]
    calls: Mapping[tuple[str, str], Callable[..., Any]]
    values: Mapping[tuple[str, str], object]

    def __or__(self, other: Allowed) -> Allowed:
        return Allowed({**self.classes, **other.classes}, {**self.calls, **other.calls},
                       {**self.values, **other.values})


class Refused(Exception):
    """A pickle holds what its table does not allow; the reader adds the file's name."""


# --- plain values by their pickled names ------------------------------------------------------

def _size(dims: Any = ()) -> torch.Size:
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int for d in dims):
        raise Refused("torch.Size takes a sequence of ints")
    return torch.Size(dims)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:
    """What torch.serialization._get_layout returns for a layout's name, and nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise Refused(f"no torch layout is named {name!r}")
    return _LAYOUTS[name]


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """Protocol 2's spelling of bytes: _codecs.encode(text, 'latin1')."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise Refused("_codecs.encode takes a str and the encoding 'latin1'")
    return text.encode("latin1")


def _bytearray(data: Any = b"", encoding: Any = None) -> bytearray:
    if isinstance(data, str) and encoding in ("latin1", "latin-1"):
        return bytearray(data.encode("latin1"))
    if not isinstance(data, bytes) or encoding is not None:
        raise Refused("bytearray takes bytes")
    return bytearray(data)


def _items(kind: type, items: Any) -> Any:
    if not isinstance(items, (list, tuple)):
        raise Refused(f"{kind.__name__} takes a list")
    return kind(items)


def _set(items: Any = ()) -> set[Any]:
    return _items(set, items)  # type: ignore[no-any-return]


def _frozenset(items: Any = ()) -> frozenset[Any]:
    return _items(frozenset, items)  # type: ignore[no-any-return]


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(x) in (int, float) for x in (real, imag)):
        raise Refused("complex takes two numbers")
    return complex(real, imag)


def _ordered_dict(items: Any = ()) -> collections.OrderedDict[Any, Any]:
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
        raise Refused("OrderedDict takes a list of pairs")
    return collections.OrderedDict(items)


def _builtins(name: str) -> list[tuple[str, str]]:
    return [("builtins", name), ("__builtin__", name)]  # protocol 2 keeps Python 2's module name


_MEMORY_FORMATS = {name: v for name, v in vars(torch).items() if isinstance(v, torch.memory_format)}
PLAIN = Allowed(
    classes={},
    calls={
        ("torch", "Size"): _size,
        ("torch.serialization", "_get_layout"): _layout,
        ("_codecs", "encode"): _latin1,
        ("collections", "OrderedDict"): _ordered_dict,
        **dict.fromkeys(_builtins("set"), _set),
        **dict.fromkeys(_builtins("frozenset"), _frozenset),
        **dict.fromkeys(_builtins("bytearray"), _bytearray),
        **dict.fromkeys(_builtins("complex"), _complex),
    },
    values={
        **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
        **{("torch", name): v for name, v in _MEMORY_FORMATS.items()},
        # how a memory format pickles itself: a dotted name under torch._utils
        **{("torch._utils", f"torch.{name}"): v for name, v in _MEMORY_FORMATS.items()},
    },
)  # fmt: skip


# --- the unpickler ------------------------------------------------------------------------------

class SafeUnpickler(pickle._Unpickler):
    """Unpickles only what ``allowed`` names (see the module's docstring); raises ``Refused``."""

    stack: list[Any]
    metastack: list[list[Any]]
    pop_mark: Callable[[], list[Any]]
    readline: Callable[[], bytes]
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, allowed: Allowed) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._classes = {id(c) for c in allowed.classes.values()}
        self._own_setstate = {id(c) for c in allowed.classes.values() if "__setstate__" in vars(c)}
        self._calls = {id(c) for c in allowed.calls.values()}
        self._names: dict[int, str] = {}
        for table in (allowed.classes, allowed.calls, allowed.values):
            for (module, name), obj in table.items():
                self._names.setdefault(id(obj), f"{module}.{name}")
        self._depths: dict[int, tuple[int, tuple[Any, ...] | frozenset[Any]]] = {}

    def _name(self, obj: Any) -> str:
        """What the pickle called ``obj``, or what ``obj`` is."""
        if id(obj) in self._names:
            return self._names[id(obj)]
        kind = obj if isinstance(obj, type) else type(obj)
        return f"{kind.__module__}.{kind.__qualname__}"

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        for table in (self._allowed.classes, self._allowed.calls, self._allowed.values):
            if key in table:
                return table[key]
        raise Refused(f"refers to {module}.{name}, which it never holds")

    def get_extension(self, code: int) -> None:
        """EXT1/2/4: the name registered for ``code`` in copyreg, through find_class (pickle's
        own keeps what it found in a cache that every unpickler of the process shares)."""
        key = pickle._inverted_registry.get(code)  # type: ignore[attr-defined]  # copyreg's, as pickle sees it
        if not key:
            raise Refused(f"refers to the extension code {code}, which names nothing")
        self.stack.append(self.find_class(*key))

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("refers to a persistent object (a tensor's storage), which it never holds")

    # opcodes that call something: only the table's classes and functions
    def _reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in self._calls:
            how = "makes from its fields" if id(func) in self._classes else "never calls"
            raise Refused(f"calls {self._name(func)}, which it {how}")
        if type(args) is not tuple:
            raise Refused(f"calls {self._name(func)} with {type(args).__name__} arguments")
        try:
            self.stack[-1] = func(*args)
        except (Refused, TypeError) as e:  # TypeError: the wrong number of arguments
            raise Refused(f"calls {self._name(func)} wrongly: {e}") from e

    def _newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, {})

    def _newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        name = self._name(cls)
        if id(cls) not in self._classes:
            raise Refused(f"makes an object of {name}, which it never holds")
        if args != () or kwargs != {}:
            raise Refused(f"makes a {name} from arguments; it holds one made from its fields")
        return cls.__new__(cls)

    def _build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        kind = type(inst)
        if id(kind) not in self._classes:
            what = "the class" if isinstance(inst, type) else "an object of"
            raise Refused(f"sets the state of {what} {self._name(inst)}, which it never does")
        if id(kind) in self._own_setstate:  # the class's own rule (TensorProperties)
            if type(state) is not tuple:
                raise Refused(f"gives a {self._name(kind)} a {type(state).__name__} state, not a tuple")
            try:
                inst.__setstate__(state)
            except Exception as e:
                raise Refused(f"gives a {self._name(kind)} a state it refuses ({type(e).__name__}: {e})") from e
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if type(state) is not dict or not all(type(k) is str and not k.startswith("__") for k in state):
            raise Refused(f"gives a {self._name(kind)} a state that is not a dict of its fields")
        inst.__dict__.update(state)

    def _inst(self) -> None:
        module, name = (self.readline()[:-1].decode("utf-8", "replace") for _ in range(2))
        raise Refused(f"makes an object of {module}.{name} by the INST opcode (pickle protocol 0), which it never "
                      "uses")

    def _obj(self) -> None:
        items = self.pop_mark()
        what = self._name(items[0]) if items else "nothing"
        raise Refused(f"makes an object of {what} by the OBJ opcode (pickle protocol 1), which it never uses")

    # opcodes that call a method of an object on the stack: only on the containers that have it
    def _append(self) -> None:
        self._container(self.stack[-2] if len(self.stack) > 1 else None, (list,), "appends to")
        pickle._Unpickler.load_append(self)  # type: ignore[attr-defined]

    def _appends(self) -> None:
        self._container(self._below_mark(), (list,), "appends to")
        pickle._Unpickler.load_appends(self)  # type: ignore[attr-defined]

    def _setitem(self) -> None:
        self._container(self.stack[-3] if len(self.stack) > 2 else None, (dict, collections.OrderedDict),
                        "sets an item of")
        pickle._Unpickler.load_setitem(self)  # type: ignore[attr-defined]

    def _setitems(self) -> None:
        self._container(self._below_mark(), (dict, collections.OrderedDict), "sets items of")
        pickle._Unpickler.load_setitems(self)  # type: ignore[attr-defined]

    def _additems(self) -> None:
        self._container(self._below_mark(), (set,), "adds items to")
        pickle._Unpickler.load_additems(self)  # type: ignore[attr-defined]

    def _below_mark(self) -> Any:
        """The object that APPENDS, SETITEMS and ADDITEMS change: the one below the mark."""
        below = self.metastack[-1] if self.metastack else []
        return below[-1] if below else None

    def _container(self, target: Any, kinds: tuple[type, ...], what: str) -> None:
        if type(target) not in kinds:
            raise Refused(f"{what} {'the class' if isinstance(target, type) else 'a'} {self._name(target)}")

    # opcodes that make tuples: a bounded depth (see the module's docstring)
    def _tuple(self, handler: Callable[[Any], None]) -> None:
        handler(self)
        made = self.stack[-1]
        depth = 1
        for x in made:
            if type(x) is tuple or type(x) is frozenset:
                known = self._depths.get(id(x))
                inner = known[0] if known is not None and known[1] is x else 1
                depth = max(depth, inner + 1)
        if depth > MAX_DEPTH:
            raise Refused(f"nests tuples more than {MAX_DEPTH} deep (hashing them would crash the process)")
        if depth > 1:
            self._depths[id(made)] = (depth, made)  # kept alive, so that its id stays its own


def _install() -> None:
    table, base = SafeUnpickler.dispatch, pickle._Unpickler
    for code, method in ((pickle.REDUCE, SafeUnpickler._reduce), (pickle.NEWOBJ, SafeUnpickler._newobj),
                         (pickle.NEWOBJ_EX, SafeUnpickler._newobj_ex), (pickle.BUILD, SafeUnpickler._build),
                         (pickle.INST, SafeUnpickler._inst), (pickle.OBJ, SafeUnpickler._obj),
                         (pickle.APPEND, SafeUnpickler._append), (pickle.APPENDS, SafeUnpickler._appends),
                         (pickle.SETITEM, SafeUnpickler._setitem), (pickle.SETITEMS, SafeUnpickler._setitems),
                         (pickle.ADDITEMS, SafeUnpickler._additems)):
        table[code[0]] = method
    for code, name in ((pickle.TUPLE, "load_tuple"), (pickle.TUPLE1, "load_tuple1"), (pickle.TUPLE2, "load_tuple2"),
                       (pickle.TUPLE3, "load_tuple3"), (pickle.FROZENSET, "load_frozenset")):
        table[code[0]] = functools.partial(SafeUnpickler._tuple, handler=getattr(base, name))


_install()


def loads(data: bytes, allowed: Allowed, path: str, what: str) -> Any:
    """``data`` unpickled by ``SafeUnpickler``; a refusal or a damaged pickle raises
    CorruptCheckpointError naming ``path`` and ``what`` the pickle is."""
    try:
        return SafeUnpickler(data, allowed).load()
    except Refused as e:
        raise CorruptCheckpointError(
            f"{path}: {what} {e}. It holds only DCP's own classes and plain values, so the file is crafted or "
            "damaged, and unpickling it as such could run code from it; if you trust this checkpoint, pass "
            "trust_metadata=True (a plain unpickle, which runs whatever the file names)") from e
    except Exception as e:  # a truncated or damaged pickle fails in many ways
        raise CorruptCheckpointError(f"{path}: {what} cannot be read ({type(e).__name__}: {e}); it is damaged, or "
                                     "not a DCP checkpoint") from e


def loads_trusted(data: bytes) -> Any:
    """A plain unpickle, which runs whatever the pickle names: for files the caller vouches for."""
    return pickle.loads(data)


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# --- non-tensor values --------------------------------------------------------------------------

def plain_value(data: bytes, path: str, fqn: str) -> io.BytesIO:
    """The ``torch.save`` bytes of a non-tensor value, for DCP's planner, which unpickles them
    with ``weights_only=False``: the value is read with ``SafeUnpickler`` (plain data, dtypes,
    sizes) and saved again, so the planner unpickles only bytes made here, never the file's."""
    what = f"the non-tensor value {fqn!r}"
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = [i for i in archive.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(names) != 1 or names[0].compress_type != zipfile.ZIP_STORED:
            raise ValueError("not one uncompressed data.pkl")
        pickled = archive.read(names[0])
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, RuntimeError, NotImplementedError) as e:
        raise CorruptCheckpointError(f"{path}: {what} is not a torch.save archive ({e}); it is damaged, or written "
                                     "by a planner of its own (pass trust_metadata=True if you trust it)") from e
    value = loads(pickled, PLAIN, path, what)
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out
