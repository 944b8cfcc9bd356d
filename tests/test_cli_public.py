"""The ``ckptstream`` command is a user of the public API: no module of ``cli/`` imports a private
module of the package (``ckptstream._...``), and the benchmark is imported only inside the
``bench`` command (``inspect`` and ``verify`` do not load it). The test walks the syntax trees."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstream._format import header
from ckptstream.cli import _files
from tests.helpers import child_env

CLI = Path(__file__).resolve().parents[1] / "src" / "ckptstream" / "cli"


def _absolute(node: ast.ImportFrom) -> list[str]:
    """The dotted names an import in ``cli/`` binds, as absolute names (cli is ``ckptstream.cli``)."""
    if node.level == 0:
        base = node.module or ""
    else:
        package = ["ckptstream", "cli"][: 2 - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return [f"{base}.{a.name}" for a in node.names]


def findings(tree: ast.Module) -> list[str]:
    found = []
    module_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = _absolute(node)
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "ckptstream":
                continue
            outside_cli = parts[1:2] != ["cli"]
            if outside_cli and any(p.startswith("_") for p in parts[1:]):
                found.append(f"line {node.lineno}: imports the private {name}")
            if parts[1:2] == ["bench"] and id(node) in module_level:
                found.append(f"line {node.lineno}: imports {name} at module level")
    return found


@pytest.mark.parametrize("module", sorted(p.name for p in CLI.glob("*.py")))
def test_the_cli_imports_only_the_public_api(module: str) -> None:
    found = findings(ast.parse((CLI / module).read_text(), module))
    assert found == [], f"cli/{module}:\n  " + "\n  ".join(found)


PLANTED = {
    "from .._format.structure import KeyPath": True,
    "from .. import _errors": True,
    "from ..storage import _private": True,
    "import ckptstream._checkpoint.load": True,
    "from ckptstream._storage import storage_for": True,
    "from .. import bench": True,
    "import ckptstream.bench": True,
    "def run():\n    from .. import bench": False,
    "from . import _dirs": False,
    "from ..storage import storage_for": False,
    "from ..dcp import StreamReader": False,
    "import ckptstream": False,
}


@pytest.mark.parametrize(("source", "flagged"), PLANTED.items(), ids=list(PLANTED))
def test_the_walk_finds_private_imports(source: str, flagged: bool) -> None:
    assert bool(findings(ast.parse(source))) is flagged


def test_the_cli_constants_are_the_formats() -> None:
    """The CLI reads a damaged header's bytes itself: its constants are the format's."""
    assert (_files.HEADER_CRC_KEY, _files.MAX_HEADER) == (header.HEADER_CRC_KEY, header.MAX_HEADER)


@pytest.mark.parametrize("module", ["ckptstream", "ckptstream.cli"])
def test_the_command_runs_as_a_module(module: str) -> None:
    """``python -m ckptstream`` and ``python -m ckptstream.cli`` are the command (as the
    ``ckptstream`` console script, ``ckptstream.cli:main``, is)."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ckptstream "), proc.stdout
    assert {"inspect", "verify", "export-hf", "bench"} <= set(proc.stdout.split("{", 1)[1].split("}", 1)[0].split(","))
