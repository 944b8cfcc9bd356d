"""What ``ckptstream inspect`` prints: a checkpoint file's tensors, values, metadata and
structure, with long containers collapsed; a CheckpointManager directory's steps, a step
folder's files, a DCP checkpoint's tensors and files. Text from files is escaped for the
terminal."""

from __future__ import annotations

from typing import Any

from ckptstream import TensorEntry

from ._dirs import DCP, MANAGER, STEP
from ._folders import FILES

KeyPath = tuple[Any, ...]  # the keys from the state's root to a leaf (``TensorEntry.path``)


def key_str(path: KeyPath) -> str:
    """A key path as ``TensorEntry.key`` writes it."""
    return ".".join(str(k) for k in path) if path else "<root>"

# C0, DEL and C1 (U+0080..U+009F: U+009B is a one-character CSI to some terminals)
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)]}
MAX_ITEMS = 10  # the table shows this many items of a container (list, dict), then a count


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (ANSI escapes) and characters that
    cannot be encoded (lone surrogates) shown as escapes."""
    return text.translate(_CONTROL).encode("utf-8", "backslashreplace").decode("utf-8")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class Collapse:
    """Which leaves a table shows: those within the first ``max_items`` items of every container
    that holds them (``max_items`` 0: all). Each container that holds more shows one line, in
    place of the first leaf it hides, saying how many items and leaves it hides."""

    def __init__(self, paths: list[KeyPath], max_items: int) -> None:
        self.max_items = max_items
        items: dict[KeyPath, dict[Any, int]] = {}  # per container: its items' positions
        self.hider: list[KeyPath | None] = []  # per leaf: the outermost container hiding it
        self.item: list[Any] = []  # per hidden leaf: the item of its hider that holds it
        for path in paths:
            hider = None
            for depth in range(len(path)):
                positions = items.setdefault(path[:depth], {})
                position = positions.setdefault(path[depth], len(positions))
                if hider is None and max_items and position >= max_items:
                    hider = path[:depth]
            self.hider.append(hider)
            self.item.append(path[len(hider)] if hider is not None else None)
        self.size = {container: len(positions) for container, positions in items.items()}

    def lines(self, rows: list[tuple[int, str]], what: tuple[str, str]) -> list[str]:
        """The lines of ``rows`` (leaf index, line) that are shown, with the count lines; ``what``
        names one leaf and several ("tensor", "tensors")."""
        hidden: dict[KeyPath, int] = {}
        hidden_items: dict[KeyPath, set[Any]] = {}
        for leaf, _ in rows:
            hider = self.hider[leaf]
            if hider is not None:
                hidden[hider] = hidden.get(hider, 0) + 1
                hidden_items.setdefault(hider, set()).add(self.item[leaf])
        out, said = [], set()
        for leaf, line in rows:
            hider = self.hider[leaf]
            if hider is None:
                out.append(line)
            elif hider not in said:
                said.add(hider)
                leaves, held = hidden[hider], len(hidden_items[hider])
                out.append(printable(
                    f"  ... {leaves} more {what[leaves != 1]} in {held} more item{'s' * (held != 1)} of "
                    f"{key_str(hider)} (it holds {self.size[hider]} items, the first {self.max_items} shown; "
                    "--max-items 0 shows all)"))
        return out


NAME_WIDTH = 60  # the name column's width at most: a longer key has a line of its own, the columns below it


def print_report(d: dict[str, Any], max_items: int = MAX_ITEMS) -> None:
    print(printable(f"{d['path']}: {d['format']}, {len(d['tensors'])} tensors, {_human(d['data_bytes'])} of data "
                    f"from byte {d['data_offset']}, checksums: {d['checksums'] or 'none'}"))
    leaves = d["_leaves"]
    collapse = Collapse([path for path, _ in leaves], max_items)
    tensors = [(i, leaf) for i, (_, leaf) in enumerate(leaves) if isinstance(leaf, TensorEntry)]
    keys = {i: printable(e.key) for i, e in tensors}
    width = max([n for i, _ in tensors if collapse.hider[i] is None and (n := len(keys[i])) <= NAME_WIDTH] + [4])
    rows = []
    for i, e in tensors:
        alias = printable(f"  (stored as {e.stored_as})") if e.stored_as != e.key else ""
        shape = str(list(e.shape))
        name = keys[i] if len(keys[i]) <= width else f"{keys[i]}\n  {'':<{width}}"  # wrapped, the columns kept
        rows.append((i, f"  {name:<{width}}  {e.dtype_name:<8} {shape:<20} {_human(e.nbytes)}{alias}"))
    for line in collapse.lines(rows, ("tensor", "tensors")):
        print(line)
    values = [(i, printable(f"  {key_str(path)}: {leaf!r}")) for i, (path, leaf) in enumerate(leaves)
              if not isinstance(leaf, TensorEntry)]
    if values:
        print("values:")
        for line in collapse.lines(values, ("value", "values")):
            print(line)
    if d["metadata"]:
        print("metadata:")
        for k, v in d["metadata"].items():
            print(printable(f"  {k}: {v}"))
    if any(g["tensors"] > 1 for g in d["structure"].values()):  # a flat state would repeat the tensor list
        print("structure:")
        for key, group in d["structure"].items():
            print(printable(f"  {key}: {group['tensors']} tensors, {_human(group['bytes'])}"))


def print_list(title: str, lines: list[str], max_items: int, what: str) -> None:
    """A flat list (steps, files, DCP tensors): its first ``max_items`` lines and a count."""
    print(title)
    shown = lines if not max_items else lines[:max_items]
    for line in shown:
        print(printable(line))
    if len(lines) > len(shown):
        print(f"  ... {len(lines) - len(shown)} more {what} (--max-items 0 shows all)")



def print_directory(d: dict[str, Any], max_items: int) -> None:
    if d["kind"] == MANAGER:
        complete = sum(s["complete"] for s in d["steps"])
        latest = f" (latest: step {d['latest']})" if d["latest"] is not None else ""
        lines = [f"  step {s['step']}  complete: {len(s['files'])} file(s), {_human(sum(s['files'].values()))}"
                 if s["complete"] else f"  step {s['step']}  incomplete: {s['reason']}" for s in d["steps"]]
        print_list(f"{d['path']}: {MANAGER}, {len(d['steps'])} step folders, {complete} complete{latest}",
                    lines, max_items, "steps")
        if d["latest"] is not None:
            print(printable(f"one step's files: ckptstream inspect {d['path']} --step {d['latest']}"))
    elif d["kind"] == FILES:
        lines = [f"  {name}  {_human(size)}" for name, size in d["files"].items()]
        index = f", a Hugging Face export ({d['index']})" if d["index"] else ""
        print_list(f"{d['path']}: {FILES}{index}, {len(lines)} file(s)", lines, max_items, "files")
        for report in d["reports"]:
            print()
            print_report(report, max_items)
    elif d["kind"] == STEP:
        if not d["complete"]:
            print(printable(f"{d['path']}: {STEP}, INCOMPLETE: {d['reason']}"))
            return
        lines = [f"  {name}  {_human(size)}" for name, size in d["files"].items()]
        print_list(f"{d['path']}: {STEP}, step {d['step']}, complete, {d['world_size']} rank(s)", lines, max_items,
                    "files")
        for report in d["reports"]:
            print()
            print_report(report, max_items)
    else:
        print_list(f"{d['path']}: {DCP}, {len(d['tensors'])} tensors, {len(d['values'])} other values, "
                    f"{len(d['files'])} files", [f"  {t['key']}  {t['dtype']}  {t['shape']}  {t['chunks']} chunk(s)"
                                                 for t in d["tensors"]], max_items, "tensors")
        if d["values"]:
            print_list("values (stored as bytes):", [f"  {v}" for v in d["values"]], max_items, "values")
        print_list("files:", [f"  {name}  {f['chunks']} chunk(s), "
                               f"{_human(f['bytes']) if f['bytes'] is not None else 'MISSING'}"
                               for name, f in d["files"].items()], max_items, "files")


