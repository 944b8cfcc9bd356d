"""The ``ckptstream`` command: inspect and verify checkpoint files, run the benchmark.

Exit codes: 0 success, 1 a corrupt checkpoint, 2 a usage error (bad arguments, unreadable file);
``verify`` of several files exits with the worst of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from . import _load
from ._errors import CkptStreamError
from ._header import DTYPE_NAMES
from ._reader import CheckpointReader

# C0, DEL and C1 (U+0080..U+009F: U+009B is a one-character CSI to some terminals)
T = TypeVar("T")
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)]}


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (ANSI escapes) and characters that
    cannot be encoded (lone surrogates) shown as escapes."""
    return text.translate(_CONTROL).encode("utf-8", "backslashreplace").decode("utf-8")


def _groups(reader: CheckpointReader) -> dict[str, dict[str, int]]:
    """Tensors and bytes under each top-level key of the state."""
    groups: dict[str, dict[str, int]] = {}
    for e in reader.entries():
        group = groups.setdefault(str(e.path[0]) if e.path else "<root>", {"tensors": 0, "bytes": 0})
        group["tensors"] += 1
        group["bytes"] += e.nbytes
    return groups


def inspect_report(path: str) -> dict[str, Any]:
    """What ``ckptstream inspect`` shows, as plain data."""
    with _load.open(path) as reader:
        h = reader.header
        return {
            "path": path,
            "format": reader.format,
            "tensors": [{"key": e.key, "dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape), "bytes": e.nbytes,
                         **({"stored_as": e.stored_as} if e.stored_as != e.key else {})} for e in reader.entries()],
            "values": reader.leaves,
            "data_bytes": h.data_bytes,
            "data_offset": h.data_start,
            "checksums": "crc32c" if reader.checksummed else None,
            "metadata": reader.metadata,
            "structure": _groups(reader),
        }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _print_report(d: dict[str, Any]) -> None:
    print(printable(f"{d['path']}: {d['format']}, {len(d['tensors'])} tensors, {_human(d['data_bytes'])} of data "
                    f"from byte {d['data_offset']}, checksums: {d['checksums'] or 'none'}"))
    keys = [printable(t["key"]) for t in d["tensors"]]
    width = max([len(k) for k in keys] + [4])
    for key, t in zip(keys, d["tensors"], strict=True):
        alias = printable(f"  (stored as {t['stored_as']})") if "stored_as" in t else ""
        print(f"  {key:<{width}}  {t['dtype']:<8} {t['shape']!s:<20} {_human(t['bytes'])}{alias}")
    if d["values"]:
        print("values:")
        for key, value in d["values"].items():
            print(printable(f"  {key}: {value!r}"))
    if d["metadata"]:
        print("metadata:")
        for k, v in d["metadata"].items():
            print(printable(f"  {k}: {v}"))
    if any(g["tensors"] > 1 for g in d["structure"].values()):  # a flat state would repeat the tensor list
        print("structure:")
        for key, group in d["structure"].items():
            print(printable(f"  {key}: {group['tensors']} tensors, {_human(group['bytes'])}"))


def _verify(path: str) -> int:
    def check() -> str:
        with _load.open(path) as reader:
            reader.verify()
            return (f"{len(reader)} tensors, checksums verified" if reader.checksummed
                    else "structure only: the file has no checksums")

    how, status = _reporting("verify", check)
    if how is not None:
        print(printable(f"{path}: OK ({how})"))
    return status


def _reporting(command: str, work: Callable[[], T]) -> tuple[T | None, int]:
    """``work()``'s result and exit status 0, or None and 1 (a corrupt checkpoint) or 2 (an
    unreadable file, bad input) with the error on stderr."""
    try:
        return work(), 0
    except (CkptStreamError, OSError, ValueError) as e:
        print(printable(f"ckptstream {command}: {e}"), file=sys.stderr)
        return None, 1 if isinstance(e, CkptStreamError) else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstream", description=(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="list the tensors, values, metadata and structure of a checkpoint")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check = sub.add_parser("verify", help="check checkpoints' headers, structure and checksums")
    check.add_argument("paths", nargs="+", metavar="path")
    from . import bench

    bench.add_arguments(sub.add_parser("bench", help="measure ckptstream against the disk, PCIe and its peers"))
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from . import bench

        return bench.run(args)
    if args.command == "verify":
        return max(_verify(path) for path in args.paths)
    report, status = _reporting("inspect", lambda: inspect_report(args.path))
    if report is None:
        return status
    if args.json:
        # ensure_ascii escapes control characters and lone surrogates; NaN and Infinity are no JSON
        print(json.dumps(_finite(report), indent=2, ensure_ascii=True, allow_nan=False, default=repr))
    else:
        _print_report(report)
    return 0


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:  # `ckptstream inspect ... | head`: the reader went away, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
