"""Errors that say what to do: a module or optimizer saved instead of its state_dict(); a
torch.compile'd model's keys (``_orig_mod.``) against a plain model's, both ways; a folder that
cannot be written (named, with the target, not the temp file)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from tests.helpers import as_bytes, child_env, random_tensor


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# --- a module, not its state ----------------------------------------------------------------


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


@pytest.mark.parametrize("where", ["root", "nested"])
@pytest.mark.parametrize("what", ["module", "optimizer"])
def test_saving_a_module_says_pass_its_state_dict(tmp_path: Path, where: str, what: str) -> None:
    model = _model()
    value: Any = model if what == "module" else torch.optim.AdamW(model.parameters())
    state = value if where == "root" else {"model": model.state_dict(), "extra": [1, value]}
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(ckptstream.UnsupportedTypeError) as e:
        ckptstream.save(state, path)
    message = str(e.value)
    assert message.startswith("<root>: " if where == "root" else "extra.1: "), message
    assert f"a torch {what}: pass {what}.state_dict() instead" in message
    assert type(value).__qualname__ in message
    assert "numpy" not in message
    assert list(tmp_path.iterdir()) == []


# --- torch.compile's _orig_mod. -------------------------------------------------------------


def _compiled_pair() -> tuple[torch.nn.Module, Any]:  # torch.compile is typed as returning a callable
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.compile's own, on some releases
        compiled = torch.compile(model)
    return model, compiled


def test_load_into_names_the_compile_prefix_both_ways(tmp_path: Path) -> None:
    model, compiled = _compiled_pair()
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    from_compiled, from_plain = tmp_path / "compiled.safetensors", tmp_path / "plain.safetensors"
    ckptstream.save({"model": compiled.state_dict(), "step": 3}, from_compiled)
    ckptstream.save({"model": model.state_dict(), "step": 3}, from_plain)
    cases = [(from_compiled, model.state_dict(), "which the file's have: it was saved from a compiled model"),
             (from_plain, compiled.state_dict(), "which the state's have: it is a compiled model's")]
    for path, target, says in cases:
        with pytest.raises(ckptstream.StateMismatchError) as e:
            ckptstream.load_into({"model": target, "step": 0}, path)
        message = str(e.value)
        assert message.startswith(f"{path} does not match the state: the keys differ by torch.compile's "
                                  f"'_orig_mod.' alone, {says}"), message
        assert "strict=False" not in message  # it would load nothing
        with pytest.warns(ckptstream.StateMismatchWarning, match=f"'_orig_mod.' alone, {says}"):
            ckptstream.load_into({"model": target, "step": 0}, path, strict=False)
    # what the messages advise loads every tensor, byte for byte
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_compiled = _compiled_pair()
    ckptstream.load_into({"model": fresh_compiled.state_dict(), "step": 0}, from_compiled)
    for key, t in saved.items():
        assert as_bytes(fresh.state_dict()[key]) == as_bytes(t), key
    fresh, fresh_compiled = _compiled_pair()
    ckptstream.load_into({"model": fresh_compiled._orig_mod.state_dict(), "step": 0}, from_plain)
    for key, t in saved.items():
        assert as_bytes(fresh.state_dict()[key]) == as_bytes(t), key


def test_no_compile_hint_where_keys_differ_otherwise(tmp_path: Path) -> None:
    model, compiled = _compiled_pair()
    path = tmp_path / "compiled.safetensors"
    ckptstream.save({"model": compiled.state_dict()}, path)
    others = [
        {**model.state_dict(), "extra": random_tensor(3)},  # one key more than the prefix explains
        {k: v for k, v in list(model.state_dict().items())[1:]},  # one key fewer
        {f"x{k}": v for k, v in model.state_dict().items()},  # another prefix
    ]
    for target in others:
        with pytest.raises(ckptstream.StateMismatchError) as e:
            ckptstream.load_into({"model": target}, path)
        assert "_orig_mod.' alone" not in str(e.value)
        assert "(strict=False loads the keys both sides have)" in str(e.value)


# --- a folder that cannot be written --------------------------------------------------------


def _mount(*args: str) -> str | None:
    try:
        proc = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if proc.returncode == 0 else proc.stderr.strip() or str(proc.returncode)


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted read-only tmpfs; skipped where this machine does not let the tests mount one."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    why = _mount("-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt))
    if why is not None:
        pytest.skip(f"cannot mount a read-only tmpfs here: {why}")
    try:
        yield mnt
    finally:
        assert subprocess.run(["umount", str(mnt)], timeout=60).returncode == 0


def test_read_only_file_system_names_the_folder_and_target(read_only_fs: Path) -> None:
    path = read_only_fs / "ckpt.safetensors"
    with pytest.raises(OSError, match="Read-only file system") as e:
        ckptstream.save({"w": random_tensor(100)}, path)
    assert e.value.errno == errno.EROFS
    assert e.value.filename == str(path)
    assert f"the folder {read_only_fs} is not writable, so the file cannot be created there" in str(e.value)
    assert "tmp-" not in str(e.value)


_CHILD = """
import sys, torch, ckptstream
try:
    ckptstream.save({"w": torch.randn(100)}, sys.argv[1])
except PermissionError as e:
    print(e.errno, e.filename, e.strerror, sep="\\n")
"""


def test_folder_without_write_permission_names_the_folder_and_target(tmp_path: Path) -> None:
    """A folder of mode 0555, written by a process that the permissions apply to (root without
    the capability that overrides them)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    path = folder / "ckpt.safetensors"
    cmd = [sys.executable, "-c", _CHILD, str(path)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root overrides file permissions, and setpriv (to drop that) is not installed")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    number, filename, strerror = proc.stdout.splitlines()
    assert (int(number), filename) == (errno.EACCES, str(path))
    assert f"the folder {folder} is not writable, so the file cannot be created there" in strerror
    assert os.listdir(folder) == []
