"""The public surface: ``from ckptstream import *`` leaves the builtin ``open`` alone, and every
exception class the package raises to its users is reachable from ``ckptstream.errors``."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
import ckptstream.errors

SRC = Path(ckptstream.__file__).parent
# raised and caught inside the package, never seen by a caller
INTERNAL = {"Refused", "Unreadable", "Stopped", "_Passed", "MissingAccount"}  # (Azure's: raised as NoCredentialsError)


def test_star_import_keeps_the_builtin_open() -> None:
    namespace: dict[str, object] = {}
    exec("from ckptstream import *", namespace)
    assert "open" not in namespace
    exec("f = open", {**namespace, "__builtins__": builtins}, namespace)
    assert namespace["f"] is builtins.open
    assert callable(ckptstream.open)
    assert ckptstream.open is not builtins.open  # type: ignore[comparison-overlap]


def _raised_names() -> set[str]:
    """The names of the package's own classes that a ``raise`` statement of its source names."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name):
                    names.add(exc.id)
                elif isinstance(exc, ast.Attribute):
                    names.add(exc.attr)
    return names


def _package_classes() -> dict[str, type[BaseException]]:
    """Every exception or warning class defined in the package (all its modules imported)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages([str(SRC)], "ckptstream."):
        if info.name.endswith("__main__"):  # runs the command when imported
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) \
                    and value.__module__.startswith("ckptstream"):
                found[value.__name__] = value
    return found


def test_every_public_exception_is_in_ckptstream_errors() -> None:
    classes = _package_classes()
    public = set(ckptstream.errors.__all__)
    raised = {name for name in _raised_names() if name in classes} - INTERNAL
    assert raised, "the scan found no raise of the package's own classes"
    assert raised - public == set()
    # and every subclass of the base or warning the package defines, raised by name or not
    ours = {name for name, cls in classes.items()
            if issubclass(cls, (ckptstream.errors.CkptStreamError, Warning))}
    assert ours - public == set()
    for name in public:
        assert getattr(ckptstream.errors, name) is classes[name]


def test_device_parameters_are_typed_device_not_any() -> None:
    """``ckptstream.Device`` (a torch.device, a str or an int) wherever a device is taken."""
    import typing

    assert set(typing.get_args(ckptstream.Device)) == {str, int, torch.device}
    calls: list[Callable[..., Any]] = [ckptstream.load, ckptstream.load_into, ckptstream.CheckpointManager.load,
             ckptstream.CheckpointManager.load_into, ckptstream.CheckpointReader.read,
             ckptstream.CheckpointReader.load, ckptstream.CheckpointReader.get_slice]
    for call in calls:  # the annotations as written (the modules postpone their evaluation)
        hint = str(inspect.signature(call).parameters["device"].annotation)
        assert hint.split(" | ")[0] == "Device", (call.__qualname__, hint)


@pytest.mark.parametrize("mode", ["pinned", "DEVICE", 1, None])
def test_a_bad_mode_is_refused_alike_by_every_entry_point(tmp_path: Path, mode: Any) -> None:
    """One parser (``AsyncMode.parse``) behind save_async, the manager, DCP's writer and capture."""
    import ckptstream.dcp
    from ckptstream._checkpoint.capture import capture

    message = rf"^mode must be one of \['device', 'lazy', 'host'\], got {re.escape(repr(mode))}$"
    state = {"w": torch.zeros(3)}
    calls: list[Callable[[], object]] = [
        lambda: ckptstream.save_async(state, tmp_path / "a.safetensors", mode=mode),
        lambda: ckptstream.CheckpointManager(tmp_path / "ckpts", mode=mode),
        lambda: ckptstream.dcp.StreamWriter(tmp_path / "dcp", mode=mode),
        lambda: capture([state["w"]], mode),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    assert not (tmp_path / "a.safetensors").exists()
    assert ckptstream.AsyncMode.parse("lazy") is ckptstream.AsyncMode.LAZY
