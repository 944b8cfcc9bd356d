"""Above the storage seam nothing touches files itself: every module of the package outside the
storage wing (``_storage/``) reads and writes through the seam's interfaces. The test walks
each module's syntax tree and fails on calls that open, read, write, sync, rename, remove, list
or stat files or descriptors, and on imports of the local implementation's modules.

Told apart from storage: anonymous host memory (``mmap.mmap(-1, ...)``: the staging buffers and
a load's host allocations map no file, and the first argument says so), ``os.devnull`` (the CLI
silences its own output), the process's own ``/proc/self/`` files (the engine finds the CUDA
runtime among its mapped libraries), and ``open`` where a module binds that name itself (``ckptstream.open``,
the reader). Not walked: the storage wing, and the benchmark (``bench/``), which measures the
disk's raw ceilings and the peers' libraries with calls of their own and uses only the public
API of the package.

Every module is on the seam: ``NOT_YET_PORTED`` is empty. A module that must touch files for a
while would be listed there with its reason, and an entry whose module no longer does fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ckptstream"
NOT_WALKED = ("_storage", "bench")

# module (relative to the package) -> why it still touches files itself (none left: every module
# is on the seam; an entry here must come with its reason, and goes once the module is ported)
NOT_YET_PORTED: dict[str, str] = {}

# calls that touch files or descriptors: module functions, by their dotted name
FILE_CALLS = {
    *(f"os.{n}" for n in (
        "open", "fdopen", "read", "readv", "pread", "preadv", "write", "writev", "pwrite", "pwritev", "sendfile",
        "copy_file_range", "lseek", "fsync", "fdatasync", "ftruncate", "truncate", "posix_fallocate",
        "posix_fadvise", "replace", "rename", "renames", "link", "symlink", "unlink", "remove", "rmdir",
        "removedirs", "mkdir", "makedirs", "mkfifo", "scandir", "listdir", "walk", "stat", "lstat", "fstat",
        "statvfs", "fstatvfs", "chmod", "fchmod", "chown", "fchown", "utime")),
    *(f"os.path.{n}" for n in ("exists", "lexists", "isfile", "isdir", "islink", "getsize", "getmtime", "samefile")),
    "open", "io.open", "builtins.open",
}
FILE_MODULES = ("shutil", "fcntl")  # any call of theirs
FILE_METHODS = {"read_bytes", "write_bytes", "read_text", "write_text", "iterdir", "touch", "rmdir", "unlink",
                "symlink_to", "hardlink_to", "fdopen"}  # pathlib and friends
IMPLEMENTATION = {"fileio", "files", "local", "publish", "mapping"}  # of the storage wing
# the transfer primitive takes local descriptors by nature
IMPLEMENTATION_USERS = {"_checkpoint/transfer.py": {"files", "local"}}
OLD_NAMES = {"_fileio", "_publish"}


def modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in NOT_WALKED)


class Finder(ast.NodeVisitor):
    """The file calls and implementation imports of one module."""

    def __init__(self, module: str, tree: ast.Module) -> None:
        self.module = module
        self.found: list[str] = []
        self.aliases: dict[str, str] = {}  # local name -> dotted name of what it is bound to
        self.own_open = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == "open" for n in tree.body)
        self.visit(tree)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]
            self._check_import(a.name.split("."), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = ("." * node.level) + (node.module or "")
        for a in node.names:
            full = f"{base}.{a.name}" if node.module else f"{base}{a.name}"
            self.aliases[a.asname or a.name] = full.lstrip(".") if node.level == 0 else full
            if a.name == "open" and node.level:
                self.own_open = True  # the package's own open (the reader)
            self._check_import([*(node.module or "").split("."), a.name], node.lineno)

    def _check_import(self, parts: list[str], line: int) -> None:
        if OLD_NAMES & set(parts):
            self.found.append(f"line {line}: imports {'.'.join(p for p in parts if p)} (the old names)")
        if "_storage" in parts:
            rest = set(parts[parts.index("_storage") + 1 :])
            allowed = IMPLEMENTATION_USERS.get(self.module, set())
            if rest & IMPLEMENTATION - allowed:
                self.found.append(f"line {line}: imports the storage implementation {'.'.join(p for p in parts if p)}")

    def dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "open" and self.own_open:
                return None
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        first = node.args[0] if node.args else None
        if first is not None and self.dotted(first) == "os.devnull":
            pass  # not storage: the process's own output silenced
        elif isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("/proc/self/"):
            pass  # not storage: what the kernel says of this process
        elif name in FILE_CALLS or (name is not None and name.split(".")[0] in FILE_MODULES):
            self.found.append(f"line {node.lineno}: {name}()")
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "mmap" and not _anonymous(first):
            self.found.append(f"line {node.lineno}: {name or '...mmap'}() of a file")
        elif isinstance(node.func, ast.Attribute) and node.func.attr in FILE_METHODS:
            self.found.append(f"line {node.lineno}: .{node.func.attr}()")
        self.generic_visit(node)


def _anonymous(first: ast.expr | None) -> bool:
    """Whether a mapping's first argument is the literal -1: anonymous memory, no file."""
    return (isinstance(first, ast.UnaryOp) and isinstance(first.op, ast.USub)
            and isinstance(first.operand, ast.Constant) and first.operand.value == 1)


def findings(module: str) -> list[str]:
    return Finder(module, ast.parse((PACKAGE / module).read_text(), module)).found


def test_the_walk_sees_the_whole_package() -> None:
    walked = modules()
    assert {"_checkpoint/save.py", "_checkpoint/reader.py", "_checkpoint/mapped.py", "_engine/read.py",
            "_engine/write.py", "dcp/_writer.py", "_manager/directory.py", "_export/copy.py",
            "cli/__init__.py"} <= {*walked}
    assert not [m for m in walked if m.startswith(NOT_WALKED)]
    assert set(NOT_YET_PORTED) <= set(walked), "an entry names no module"


@pytest.mark.parametrize("module", modules())
def test_above_the_seam_nothing_touches_files(module: str) -> None:
    found = findings(module)
    if module in NOT_YET_PORTED:
        assert found, f"{module} no longer touches files itself: remove it from NOT_YET_PORTED"
    else:
        assert found == [], f"{module} touches files itself (use the storage seam):\n  " + "\n  ".join(found)


# --- the walk finds what it must ---------------------------------------------------------------

PLANTED = {
    "os.pwrite(fd, b'x', 0)": True,
    "os.preadv(fd, [v], 0)": True,
    "import os as o\no.fsync(3)": True,
    "from os import replace\nreplace('a', 'b')": True,
    "os.path.getsize(p)": True,
    "shutil.rmtree(p)": True,
    "fcntl.fcntl(fd, 1)": True,
    "with open(p, 'rb') as f: pass": True,
    "mmap.mmap(fd, 4096)": True,
    "libc.mmap(None, 4096, 3, 2, fd, 0)": True,
    "Path(p).read_bytes()": True,
    "from ._fileio import pwrite_all": True,
    "from . import _publish": True,
    "from ._storage.files import FileSink": True,
    "from ._storage import local": True,
    "from .._storage.files import FileSink": True,
    "mmap.mmap(-1, 4096)": False,
    "os.dup2(os.open(os.devnull, os.O_WRONLY), 1)": False,
    "from ._load import open\nopen(p)": False,
    "def open(p): pass\nopen(p)": False,
    "from ._storage import storage_for\nstorage_for(p).open(p)": False,
    "os.path.join(a, b)": False,
    "with open('/proc/self/maps') as f: pass": False,
    "with open('/proc/mounts') as f: pass": True,
}


@pytest.mark.parametrize(("source", "flagged"), PLANTED.items(), ids=list(PLANTED))
def test_the_walk_tells_file_calls_from_the_rest(source: str, flagged: bool) -> None:
    tree = ast.parse("import os, shutil, fcntl, mmap\nfrom pathlib import Path\n" + source)
    assert bool(Finder("_checkpoint/save.py", tree).found) is flagged


def test_the_transfer_primitive_may_use_the_local_implementation() -> None:
    tree = ast.parse("from ._storage.local import opened\nfrom ._storage.files import FileSink")
    assert Finder("_checkpoint/transfer.py", tree).found == []
    assert Finder("_checkpoint/save.py", tree).found
