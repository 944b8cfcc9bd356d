"""Crafted pickles against ckptstream.dcp, in a process of their own:
``python child_pickles.py cases JOB.json`` or ``python child_pickles.py fuzz DIR SEED COUNT``.

An audit hook, armed only while a crafted checkpoint is being read, records and stops every
event that would start a process, write, remove or rename a file, run code made from text,
or resolve a pickle global through one of Python's own unpicklers (``pickle.find_class``): such
an event is the proof that something in the file ran. Every case prints one JSON line: what each
entry point raised and the events seen.

``cases``: for each checkpoint directory of the job, ``read_metadata``, ``checkpoint_files`` and
``dcp.load(..., StreamReader, no_dist=True)`` (the job says which). ``fuzz``: COUNT pickles made
from SEED, each written as DIR/.metadata (while disarmed) and read by ``read_metadata`` and
``checkpoint_files``.
"""

from __future__ import annotations

import copyreg
import functools
import json
import os
import random
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckptstream.dcp
from ckptstream.dcp import _metadata, _pickles

ARMED = False
EVENTS: list[str] = []
PROCESS_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                  "pty.spawn", "os.startfile")
FILE_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "shutil.rmtree", "os.truncate", "os.symlink",
               "os.link", "os.chmod")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Stopped(BaseException):
    """Raised by the hook to stop what a crafted file started (not an Exception: nothing
    catches it by accident)."""


def _writes(args: tuple[Any, ...]) -> bool:
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    return (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(isinstance(flags, int)
                                                                               and flags & WRITE_FLAGS)


def _from_text(args: tuple[Any, ...]) -> bool:
    """exec() or eval() of code compiled from text, not of a module's file being imported
    (compiling alone runs nothing, and tracebacks compile source lines to point at them)."""
    return not str(getattr(args[0], "co_filename", "")).endswith(".py")


def hook(event: str, args: tuple[Any, ...]) -> None:
    if not ARMED:
        return
    bad = (event in PROCESS_EVENTS or event in FILE_EVENTS or event == "pickle.find_class"
           or (event == "open" and _writes(args)) or (event == "exec" and _from_text(args)))
    if bad:
        EVENTS.append(f"{event} {args!r}"[:300])
        raise Stopped(event)


def text_of(error: BaseException) -> str:
    """An error's message, its causes' and (for DCP's CheckpointException) every rank's."""
    parts, seen = [], set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return "\n".join(parts)


def run(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn`` armed: what it raised (its type, the text of the whole chain, warnings), or what
    it returned."""
    global ARMED
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ARMED = True
        try:
            value = fn()
        except BaseException as e:
            ARMED = False
            out = {"raised": type(e).__name__, "corrupt": isinstance(e, ckptstream.CorruptCheckpointError),
                   "text": text_of(e)}
        else:
            ARMED = False
            out = {"raised": None, "returned": type(value).__name__}
    out["warnings"] = [str(w.message) for w in caught]
    return out


def load(directory: str) -> None:
    state = {"w": torch.zeros(64, 5), "extra": {"step": 0}}
    dcp.load(state, storage_reader=ckptstream.dcp.StreamReader(directory), no_dist=True)


def warm_up(directory: str) -> None:
    """One legitimate pass over every entry point, so that what they import on first use is
    imported before the hook is armed."""
    _metadata.read_metadata(directory, None, trusted=False)
    ckptstream.dcp.checkpoint_files(directory)
    load(directory)
    for bad in (b"\x80\x04K\x01.", b"garbage"):  # the error paths, formatted as DCP formats them
        try:
            _pickles.loads(bad, _metadata.METADATA, "probe", "probe")
        except ckptstream.CorruptCheckpointError:
            traceback.format_exc()


ENTRY_POINTS: dict[str, Callable[[str], Any]] = {
    "read": lambda d: _metadata.read_metadata(d, None, trusted=False),
    "files": ckptstream.dcp.checkpoint_files,
    "load": load,
}


def cases(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    # an extension code registered for os.system: EXT opcodes must resolve through find_class too
    copyreg.add_extension("os", "system", 0x7A11)
    warm_up(job["warm_up"])
    for case in job["cases"]:
        EVENTS.clear()
        directory = case["dir"]
        result = {name: run(functools.partial(ENTRY_POINTS[name], directory)) for name in case["entry_points"]}
        print(json.dumps({"name": case["name"], "results": result, "events": list(EVENTS)}), flush=True)


# --- fuzz -----------------------------------------------------------------------------------------

MODULES = ["os", "posix", "builtins", "__builtin__", "subprocess", "torch", "torch.distributed.checkpoint.metadata",
           "torch.serialization", "pickle", "ckptstream.dcp", "pathlib", "collections", "_codecs", "importlib", "sys"]
NAMES = ["system", "eval", "exec", "getattr", "Popen", "Size", "float32", "Metadata", "StoredChunk", "os.system",
         "_get_layout", "loads", "load", "OrderedDict", "set", "encode", "import_module", "TensorProperties",
         "MetadataIndex", "_MEM_FORMAT_ENCODING", "PosixPath", "modules", "__reduce__", "Metadata.__init__.__globals__"]


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def fuzz_ops(rng: random.Random, sentinel: str) -> bytes:
    """A random sequence of pickle opcodes, biased to the ones that call or look up things."""
    strings = [f"touch {sentinel}", sentinel, "__import__('os').system('touch " + sentinel + "')", "x", "",
               "torch.strided", "rank-00000.safetensors", "../x"]
    ops: list[bytes] = [b"\x80" + bytes([rng.choice([2, 4, 5])])]
    for _ in range(rng.randint(1, 40)):
        kind = rng.random()
        if kind < 0.25:
            module, name = rng.choice(MODULES), rng.choice(NAMES)
            if rng.random() < 0.5:
                ops.append(b"c" + module.encode() + b"\n" + name.encode() + b"\n")
            else:
                ops.append(_text(module) + _text(name) + b"\x93")
        elif kind < 0.45:
            ops.append(rng.choice([_text(rng.choice(strings)), b"K" + bytes([rng.randrange(256)]), b"N", b"\x88",
                                   b"\x89", b"J" + rng.randbytes(4), b"C\x02ab"]))
        elif kind < 0.9:
            ops.append(rng.choice([b"R", b"b", b"\x81", b"\x92", b"o", b"(", b")", b"]", b"}", b"\x8f", b"a", b"e",
                                   b"s", b"u", b"\x90", b"t", b"\x85", b"\x86", b"\x87", b"\x91", b"l", b"d",
                                   b"0", b"2", b"\x94", b"Q", b"\x82\x01", b"\x83\x11\x7a", b"\x97", b"\x98"]))
        elif kind < 0.95:
            ops.append(b"h" + bytes([rng.randrange(4)]))
        else:
            ops.append(b"i" + rng.choice(MODULES).encode() + b"\n" + rng.choice(NAMES).encode() + b"\n")
    ops.append(b".")
    return b"".join(ops)


def mutate(rng: random.Random, base: bytes, sentinel: str) -> bytes:
    """A real .metadata with random opcodes spliced in, or bytes flipped."""
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data))
        if rng.random() < 0.5:
            data[at:at] = fuzz_ops(rng, sentinel)[2:-1]
        else:
            data[at] ^= 1 << rng.randrange(8)
    return bytes(data)


def fuzz(directory: str, seed: int, count: int) -> None:
    global ARMED
    path = Path(directory, ".metadata")
    base = path.read_bytes()
    sentinel = str(Path(directory).parent / "SENTINEL")
    warm_up(directory)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for i in range(count):
        payload = mutate(rng, base, sentinel) if i % 2 else fuzz_ops(rng, sentinel)
        path.write_bytes(payload)
        for name in ("read", "files"):
            EVENTS.clear()
            result = run(functools.partial(ENTRY_POINTS[name], directory))
            kind = "ok" if result["raised"] is None else ("corrupt" if result["corrupt"] else result["raised"])
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if EVENTS or kind not in ("ok", "corrupt") or (kind == "corrupt" and str(path) not in result["text"]):
                print(json.dumps({"case": i, "entry_point": name, "payload": payload.hex(), "result": result,
                                  "events": list(EVENTS)}), flush=True)
    print(json.dumps({"outcomes": outcomes}), flush=True)


if __name__ == "__main__":
    sys.addaudithook(hook)
    if sys.argv[1] == "cases":
        cases(sys.argv[2])
    else:
        fuzz(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
