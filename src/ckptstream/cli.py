"""The ``ckptstream`` command: inspect and verify checkpoint files, run the benchmark.

Exit codes: 0 success, 1 a corrupt checkpoint, 2 a usage error (bad arguments, unreadable file).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import _load
from ._errors import CkptStreamError
from ._header import DTYPE_NAMES
from ._reader import CheckpointReader


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
            "tensors": [{"name": t.name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "bytes": t.nbytes}
                        for t in h.tensors],
            "data_bytes": h.data_bytes,
            "data_offset": h.data_start,
            "checksums": "crc32c" if reader.checksummed else None,
            "metadata": reader.metadata,
            "structure": _groups(reader),
        }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _print_description(d: dict[str, Any]) -> None:
    print(f"{d['path']}: {d['format']}, {len(d['tensors'])} tensors, {_human(d['data_bytes'])} of data "
          f"from byte {d['data_offset']}, checksums: {d['checksums'] or 'none'}")  # fmt: skip
    width = max([len(t["name"]) for t in d["tensors"]] + [4])
    for t in d["tensors"]:
        print(f"  {t['name']:<{width}}  {t['dtype']:<8} {t['shape']!s:<20} {_human(t['bytes'])}")
    if d["metadata"]:
        print("metadata:")
        for k, v in d["metadata"].items():
            print(f"  {k}: {v}")
    print("structure:")
    for key, group in d["structure"].items():
        print(f"  {key}: {group['tensors']} tensors, {_human(group['bytes'])}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstream", description=(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="list the tensors, metadata and structure of a checkpoint")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check = sub.add_parser("verify", help="check a checkpoint's header, structure and checksums")
    check.add_argument("path")
    from . import bench

    bench.add_arguments(sub.add_parser("bench", help="measure ckptstream against the disk, PCIe and its peers"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from . import bench

        return bench.run(args)
    try:
        if args.command == "inspect":
            d = inspect_report(args.path)
            if args.json:
                print(json.dumps(d, indent=2, ensure_ascii=False))
            else:
                _print_description(d)
        else:
            _load.verify(args.path)
            print(f"{args.path}: OK")
        return 0
    except CkptStreamError as e:
        print(f"ckptstream {args.command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"ckptstream {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
