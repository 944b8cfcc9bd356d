"""The ``ckptstream`` command: inspect and verify checkpoints, run the benchmark.

A checkpoint is a file (or an object store's object), a CheckpointManager directory (every step,
or ``--step N``), one of its step folders, a DCP checkpoint's directory, or a folder of checkpoint
files (Lightning's ``.ckpt`` files, a Hugging Face export with its index). Exit codes: 0 sound,
1 a corrupt or incomplete checkpoint, 2 a usage error (bad arguments, an unreadable file, a file
of another format, a path that holds no checkpoint); ``verify`` of several checkpoints exits with
the worst of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import ckptstream

from ..storage import Entry, storage_for
from . import _dirs, _files, _folders
from ._dirs import DCP, MANAGER, STEP, Verdict, status_of
from ._folders import FILES
from ._text import MAX_ITEMS, KeyPath, print_directory, print_report, printable

T = TypeVar("T")


def _groups(reader: ckptstream.CheckpointReader) -> dict[str, dict[str, int]]:
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
    with ckptstream.open(path) as reader:
        return {
            "path": path,
            "format": reader.format,
            "tensors": [{"key": e.key, "dtype": e.dtype_name, "shape": list(e.shape), "bytes": e.nbytes,
                         **({"stored_as": e.stored_as} if e.stored_as != e.key else {})} for e in reader.entries()],
            "values": reader.leaves,
            "data_bytes": reader.data_bytes,
            "data_offset": reader.data_offset,
            "checksums": "crc32c" if reader.checksummed else None,
            "metadata": reader.metadata,
            "structure": _groups(reader),
            "_leaves": list(_leaves(reader.skeleton())),
        }


# --- verify ---------------------------------------------------------------------------------


def _verify_file(path: str, require_checksums: bool = False) -> Verdict:
    def check() -> str:
        with ckptstream.open(path, require_checksums=require_checksums) as reader:
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
    except (ckptstream.CkptStreamError, OSError, ValueError) as e:
        if isinstance(e, ckptstream.NotACheckpointError):  # a file of another format: no checkpoint at all
            return None, 2, str(e)
        message = str(e)
        if isinstance(e, ckptstream.CorruptCheckpointError):  # of a file: where its header's own CRC shows damage
            message = _files.header_damage(path) or message
        return None, status_of(e), message


def _what_is(path: str, step: int | None) -> tuple[str | None, Verdict | None]:
    """The kind of checkpoint at ``path`` ("file", MANAGER, STEP, DCP, FILES), or the verdict that it is none."""
    storage = storage_for(path)
    try:
        entries: list[Entry] | None = storage.list_folder(path)
        if not entries and storage.kind(path) != "folder":
            entries = None  # an object store lists an object's URL as an empty folder: a file
    except (FileNotFoundError, NotADirectoryError):
        entries = None  # no folder: a file (or nothing, which the reader says)
    except OSError as e:
        return None, Verdict(f"{path}: cannot be listed ({e.strerror or e})", 2)
    if entries is not None:
        kind = _dirs.folder_kind(path, entries) or (FILES if _folders.has_checkpoints(entries) else None)
        if kind is None:
            return None, Verdict(f"{path}: a folder that holds no checkpoint (checkpoint files: .safetensors, "
                                 "Lightning's .ckpt, a Hugging Face export; a CheckpointManager directory or step "
                                 "folder; a DCP checkpoint's folder)", 2)
        if step is not None and kind != MANAGER:
            return None, Verdict(f"{path}: --step picks a step of a CheckpointManager directory; this is a {kind}", 2)
        return kind, None
    if step is not None:
        return None, Verdict(f"{path}: --step picks a step of a CheckpointManager directory; this is a file", 2)
    if _dirs.is_dcp_metadata_name(os.path.basename(path)) and storage.exists(path):
        folder = os.path.dirname(path) or "."
        return None, Verdict(f"{path}: this is a DCP checkpoint's metadata, not a checkpoint file; run "
                             f"`ckptstream verify {folder}` (or inspect) on its folder", 2)
    return "file", None


def _check_files(folder: str, require_checksums: bool) -> list[Verdict]:
    """A folder of checkpoint files: its Hugging Face index against its shards (where it has
    one), then every file on its own."""
    storage = storage_for(folder)
    entries = storage.list_folder(folder)
    names = _folders.checkpoint_files(entries)
    index = [_folders.check_index(folder, names)] if any(e.name == _folders.INDEX for e in entries) else []
    return index + [_verify_file(storage.join(folder, name), require_checksums) for name in names]


def verify(path: str, step: int | None = None, require_checksums: bool = False) -> list[Verdict]:
    """The verdict on each checkpoint at ``path`` (``require_checksums``: a file without them fails)."""
    kind, refused = _what_is(path, step)
    if refused is not None:
        return [refused]
    if kind == "file":
        return [_verify_file(path, require_checksums)]
    try:
        if kind == MANAGER:
            return _dirs.check_manager(path, step)
        if kind == FILES:
            return _check_files(path, require_checksums)
        return [_dirs.check_step(ckptstream.check_step(path)) if kind == STEP else _dirs.check_dcp(path)]
    except OSError as e:  # a folder that cannot be listed or read
        return [Verdict(f"{path}: {e}", 2)]


# --- inspect --------------------------------------------------------------------------------


def inspect(path: str, step: int | None = None) -> tuple[dict[str, Any] | None, Verdict | None]:
    """What ``inspect`` shows of ``path`` as plain data, or the verdict that it cannot."""
    kind, refused = _what_is(path, step)
    if refused is not None:
        return None, refused
    check = None
    if kind == MANAGER and step is not None:
        found = _dirs.step_check(path, step)
        if isinstance(found, Verdict):  # no such step
            return None, found
        kind, check = STEP, found

    def describe() -> dict[str, Any]:
        if kind == MANAGER:
            return _dirs.describe_manager(path)
        if kind == DCP:
            return _dirs.describe_dcp(path)
        if kind == FILES:
            report = _folders.describe_files(path, storage_for(path).list_folder(path))
            report["reports"] = [inspect_report(storage_for(path).join(path, n)) for n in report["files"]]
            return report
        if kind == STEP:
            step_check = check or ckptstream.check_step(path)
            report = _dirs.describe_step(step_check)
            storage = storage_for(step_check.folder)
            report["reports"] = [inspect_report(storage.join(step_check.folder, n)) for n in report.get("files", {})]
            return report
        return inspect_report(path)

    report, status, message = _reporting(path, describe)
    return report, None if report is not None else Verdict(message, status)


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
                             "file or object, a CheckpointManager directory or step folder, a DCP checkpoint's "
                             "folder, a folder of checkpoint files such as a Hugging Face export)")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table (nothing collapsed)")
    inspect.add_argument("--step", type=int, help="of a CheckpointManager directory: this step")
    inspect.add_argument("--max-items", type=_max_items, default=MAX_ITEMS, metavar="N",
                         help=f"show N items of each list or dict, then a count (default {MAX_ITEMS}; 0: all)")
    check = sub.add_parser("verify", help="check checkpoints' headers, structure and checksums (files or "
                           "objects, CheckpointManager directories and step folders, DCP checkpoints' folders, "
                           "folders of checkpoint files: a Hugging Face export's index against its shards)")
    check.add_argument("paths", nargs="+", metavar="path")
    check.add_argument("--step", type=int, help="of a CheckpointManager directory: only this step")
    check.add_argument("--require-checksums", action="store_true",
                       help="a checkpoint file that stores no checksums fails (exit status 1) instead of being "
                            "checked for its structure only")
    from . import _export as export

    export.add_arguments(sub.add_parser("export-hf", help=export.HELP, description=export.HELP))
    bench = sub.add_parser("bench", help="measure ckptstream against the disk, PCIe and its peers")
    if argv is None or argv[:1] == ["bench"]:
        from .. import bench as benchmark

        benchmark.add_arguments(bench)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from .. import bench

        return bench.run(args)
    if args.command == "export-hf":
        from . import _export

        return _export.run(args)
    if args.command == "verify":
        status = 0
        for path in args.paths:
            for verdict in verify(path, args.step, args.require_checksums):
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
        print_directory(report, args.max_items)
    else:
        print_report(report, args.max_items)
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

