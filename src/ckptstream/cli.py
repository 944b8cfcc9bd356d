"""The ``ckptstream`` command: inspect and verify checkpoints, run the benchmark.

A checkpoint is a file, a CheckpointManager directory (every step, or ``--step N``), one of its
step folders, or a DCP checkpoint's directory. Exit codes: 0 sound, 1 a corrupt or incomplete
checkpoint, 2 a usage error (bad arguments, an unreadable file, a path that holds no
checkpoint); ``verify`` of several checkpoints exits with the worst of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from . import _cli_dirs, _cli_files, _load
from ._cli_dirs import DCP, MANAGER, STEP, Verdict
from ._errors import CkptStreamError, CorruptCheckpointError
from ._header import DTYPE_NAMES
from ._reader import CheckpointReader, TensorEntry
from ._structure import KeyPath, key_str

# C0, DEL and C1 (U+0080..U+009F: U+009B is a one-character CSI to some terminals)
T = TypeVar("T")
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)]}
MAX_ITEMS = 10  # inspect's table shows this many items of a container (list, dict), then a count


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


def _leaves(node: Any, path: KeyPath = ()) -> Iterable[tuple[KeyPath, Any]]:
    """(key path, leaf) of every leaf of a reader's skeleton (TensorEntry or value), in order."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    else:
        yield path, node


def inspect_report(path: str) -> dict[str, Any]:
    """What ``ckptstream inspect`` shows of a checkpoint file, as plain data (and, under
    "_leaves", every leaf with its key path in order, for the table: not in the JSON)."""
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
            "_leaves": list(_leaves(reader.skeleton())),
        }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class Collapse:
    """Which leaves a table shows: those within the first ``max_items`` items of every container
    that holds them (``max_items`` 0: all). Each container that holds more shows one line, in
    place of the first leaf it hides, saying how many it hides."""

    def __init__(self, paths: list[KeyPath], max_items: int) -> None:
        self.max_items = max_items
        items: dict[KeyPath, dict[Any, int]] = {}  # per container: its items' positions
        self.hider: list[KeyPath | None] = []  # per leaf: the outermost container hiding it
        for path in paths:
            hider = None
            for depth in range(len(path)):
                positions = items.setdefault(path[:depth], {})
                position = positions.setdefault(path[depth], len(positions))
                if hider is None and max_items and position >= max_items:
                    hider = path[:depth]
            self.hider.append(hider)
        self.size = {container: len(positions) for container, positions in items.items()}

    def lines(self, rows: list[tuple[int, str]], what: str) -> list[str]:
        """The lines of ``rows`` (leaf index, line) that are shown, with the count lines."""
        hidden: dict[KeyPath, int] = {}
        for leaf, _ in rows:
            hider = self.hider[leaf]
            if hider is not None:
                hidden[hider] = hidden.get(hider, 0) + 1
        out, said = [], set()
        for leaf, line in rows:
            hider = self.hider[leaf]
            if hider is None:
                out.append(line)
            elif hider not in said:
                said.add(hider)
                out.append(printable(f"  ... {hidden[hider]} more {what} under {key_str(hider) or '<root>'} (past "
                                     f"the first {self.max_items} of its {self.size[hider]} items; --max-items 0 "
                                     "shows all)"))
        return out


def _print_report(d: dict[str, Any], max_items: int = MAX_ITEMS) -> None:
    print(printable(f"{d['path']}: {d['format']}, {len(d['tensors'])} tensors, {_human(d['data_bytes'])} of data "
                    f"from byte {d['data_offset']}, checksums: {d['checksums'] or 'none'}"))
    leaves = d["_leaves"]
    collapse = Collapse([path for path, _ in leaves], max_items)
    tensors = [(i, leaf) for i, (_, leaf) in enumerate(leaves) if isinstance(leaf, TensorEntry)]
    keys = {i: printable(e.key) for i, e in tensors}
    width = max([len(keys[i]) for i, _ in tensors if collapse.hider[i] is None] + [4])
    rows = []
    for i, e in tensors:
        alias = printable(f"  (stored as {e.stored_as})") if e.stored_as != e.key else ""
        shape = str(list(e.shape))
        rows.append((i, f"  {keys[i]:<{width}}  {DTYPE_NAMES[e.dtype]:<8} {shape:<20} {_human(e.nbytes)}{alias}"))
    for line in collapse.lines(rows, "tensors"):
        print(line)
    values = [(i, printable(f"  {key_str(path)}: {leaf!r}")) for i, (path, leaf) in enumerate(leaves)
              if not isinstance(leaf, TensorEntry)]
    if values:
        print("values:")
        for line in collapse.lines(values, "values"):
            print(line)
    if d["metadata"]:
        print("metadata:")
        for k, v in d["metadata"].items():
            print(printable(f"  {k}: {v}"))
    if any(g["tensors"] > 1 for g in d["structure"].values()):  # a flat state would repeat the tensor list
        print("structure:")
        for key, group in d["structure"].items():
            print(printable(f"  {key}: {group['tensors']} tensors, {_human(group['bytes'])}"))


def _print_list(title: str, lines: list[str], max_items: int, what: str) -> None:
    """A flat list (steps, files, DCP tensors): its first ``max_items`` lines and a count."""
    print(title)
    shown = lines if not max_items else lines[:max_items]
    for line in shown:
        print(printable(line))
    if len(lines) > len(shown):
        print(f"  ... {len(lines) - len(shown)} more {what} (--max-items 0 shows all)")


# --- verify ---------------------------------------------------------------------------------


def _verify_file(path: str) -> Verdict:
    def check() -> str:
        with _load.open(path) as reader:
            reader.verify()
            return (f"{len(reader)} tensors, checksums verified" if reader.checksummed
                    else "structure only: the file has no checksums")

    how, status, message = _reporting(path, check)
    return Verdict(f"{path}: OK ({how})" if how is not None else message, status)


def _reporting(path: str, work: Callable[[], T]) -> tuple[T | None, int, str]:
    """``work()``'s result and exit status 0, or None, 1 (a corrupt checkpoint) or 2 (an
    unreadable file, bad input) and what to say: the error, or where a damaged header or a file
    of another kind tells more."""
    try:
        return work(), 0, ""
    except (CkptStreamError, OSError, ValueError) as e:
        message = str(e)
        if isinstance(e, CorruptCheckpointError) and os.path.isfile(path):
            other = _cli_files.other_kind(path)
            if other is not None:
                return None, 2, f"{path}: {other}"
            message = _cli_files.header_damage(path) or message
        return None, 1 if isinstance(e, CkptStreamError) else 2, message


def _what_is(path: str, step: int | None) -> tuple[str | None, Verdict | None]:
    """The kind of checkpoint at ``path`` ("file", MANAGER, STEP, DCP), or the verdict that it is none."""
    if os.path.isdir(path):
        try:
            kind = _cli_dirs.folder_kind(path)
        except OSError as e:
            return None, Verdict(f"{path}: cannot be listed ({e.strerror})", 2)
        if kind is None:
            return None, Verdict(f"{path}: a folder that holds no checkpoint (a checkpoint file, a CheckpointManager "
                                 "directory or step folder, or a DCP checkpoint's folder)", 2)
        if step is not None and kind != MANAGER:
            return None, Verdict(f"{path}: --step picks a step of a CheckpointManager directory; this is a {kind}", 2)
        return kind, None
    if step is not None:
        return None, Verdict(f"{path}: --step picks a step of a CheckpointManager directory; this is a file", 2)
    if _cli_dirs.is_dcp_metadata_name(os.path.basename(path)) and os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        return None, Verdict(f"{path}: this is a DCP checkpoint's metadata, not a checkpoint file; run "
                             f"`ckptstream verify {folder}` (or inspect) on its folder", 2)
    return "file", None


def verify(path: str, step: int | None = None) -> list[Verdict]:
    """The verdict on each checkpoint at ``path``."""
    kind, refused = _what_is(path, step)
    if refused is not None:
        return [refused]
    if kind == MANAGER:
        return _cli_dirs.check_manager(path, step)
    if kind == STEP:
        return [_cli_dirs.check_step(path)]
    if kind == DCP:
        return [_cli_dirs.check_dcp(path)]
    return [_verify_file(path)]


# --- inspect --------------------------------------------------------------------------------


def inspect(path: str, step: int | None = None) -> tuple[dict[str, Any] | None, Verdict | None]:
    """What ``inspect`` shows of ``path`` as plain data, or the verdict that it cannot."""
    kind, refused = _what_is(path, step)
    if refused is not None:
        return None, refused
    if kind == MANAGER and step is not None:
        folders = _cli_dirs.check_manager(path, step)
        if folders[0].status == 2:  # no such step
            return None, folders[0]
        kind, path = STEP, _layout_step_dir(path, step)

    def describe() -> dict[str, Any]:
        if kind == MANAGER:
            return _cli_dirs.describe_manager(path)
        if kind == DCP:
            return _cli_dirs.describe_dcp(path)
        if kind == STEP:
            report = _cli_dirs.describe_step(path)
            report["reports"] = [inspect_report(os.path.join(path, n)) for n in report.get("files", {})]
            return report
        return inspect_report(path)

    report, status, message = _reporting(path, describe)
    return report, None if report is not None else Verdict(message, status)


def _layout_step_dir(directory: str, step: int) -> str:
    from . import _layout

    return _layout.step_dirs(directory)[step]


def _print_directory(d: dict[str, Any], max_items: int) -> None:
    if d["kind"] == MANAGER:
        complete = sum(s["complete"] for s in d["steps"])
        latest = f" (latest: step {d['latest']})" if d["latest"] is not None else ""
        lines = [f"  step {s['step']}  complete: {len(s['files'])} file(s), {_human(sum(s['files'].values()))}"
                 if s["complete"] else f"  step {s['step']}  incomplete: {s['reason']}" for s in d["steps"]]
        _print_list(f"{d['path']}: {MANAGER}, {len(d['steps'])} step folders, {complete} complete{latest}",
                    lines, max_items, "steps")
        if d["latest"] is not None:
            print(printable(f"one step's files: ckptstream inspect {d['path']} --step {d['latest']}"))
    elif d["kind"] == STEP:
        if not d["complete"]:
            print(printable(f"{d['path']}: {STEP}, INCOMPLETE: {d['reason']}"))
            return
        lines = [f"  {name}  {_human(size)}" for name, size in d["files"].items()]
        _print_list(f"{d['path']}: {STEP}, step {d['step']}, complete, {d['world_size']} rank(s)", lines, max_items,
                    "files")
        for report in d["reports"]:
            print()
            _print_report(report, max_items)
    else:
        _print_list(f"{d['path']}: {DCP}, {len(d['tensors'])} tensors, {len(d['values'])} other values, "
                    f"{len(d['files'])} files", [f"  {t['key']}  {t['dtype']}  {t['shape']}  {t['chunks']} chunk(s)"
                                                 for t in d["tensors"]], max_items, "tensors")
        if d["values"]:
            _print_list("values (stored as bytes):", [f"  {v}" for v in d["values"]], max_items, "values")
        _print_list("files:", [f"  {name}  {f['chunks']} chunk(s), "
                               f"{_human(f['bytes']) if f['bytes'] is not None else 'MISSING'}"
                               for name, f in d["files"].items()], max_items, "files")


def _plain(report: Any) -> Any:
    """``report`` without its private keys (the table's), for the JSON."""
    if isinstance(report, dict):
        return {k: _plain(v) for k, v in report.items() if not k.startswith("_")}
    if isinstance(report, list):
        return [_plain(v) for v in report]
    return report


# --- the command ----------------------------------------------------------------------------


def _max_items(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all) or more, got {value}")
    return value


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the benchmark's options (and the benchmark's modules) only where ``argv`` runs
    it (or is not given)."""
    parser = argparse.ArgumentParser(prog="ckptstream", description=(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="list the tensors, values, metadata and structure of a checkpoint (a "
                             "file, a CheckpointManager directory or step folder, a DCP checkpoint's folder)")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table (nothing collapsed)")
    inspect.add_argument("--step", type=int, help="of a CheckpointManager directory: this step")
    inspect.add_argument("--max-items", type=_max_items, default=MAX_ITEMS, metavar="N",
                         help=f"show N items of each list or dict, then a count (default {MAX_ITEMS}; 0: all)")
    check = sub.add_parser("verify", help="check checkpoints' headers, structure and checksums (files, "
                           "CheckpointManager directories and step folders, DCP checkpoints' folders)")
    check.add_argument("paths", nargs="+", metavar="path")
    check.add_argument("--step", type=int, help="of a CheckpointManager directory: only this step")
    bench = sub.add_parser("bench", help="measure ckptstream against the disk, PCIe and its peers")
    if argv is None or argv[:1] == ["bench"]:
        from . import bench as benchmark

        benchmark.add_arguments(bench)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from . import bench

        return bench.run(args)
    if args.command == "verify":
        status = 0
        for path in args.paths:
            for verdict in verify(path, args.step):
                if verdict.status == 0:
                    print(printable(verdict.line))
                else:
                    print(printable(f"ckptstream verify: {verdict.line}"), file=sys.stderr)
                status = max(status, verdict.status)
        return status
    report, refused = inspect(args.path, args.step)
    if refused is not None or report is None:
        assert refused is not None
        print(printable(f"ckptstream inspect: {refused.line}"), file=sys.stderr)
        return refused.status
    if args.json:
        # ensure_ascii escapes control characters and lone surrogates; NaN and Infinity are no JSON
        print(json.dumps(_finite(_plain(report)), indent=2, ensure_ascii=True, allow_nan=False, default=repr))
    elif "kind" in report:
        _print_directory(report, args.max_items)
    else:
        _print_report(report, args.max_items)
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
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:  # `ckptstream inspect ... | head`: the reader went away, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
