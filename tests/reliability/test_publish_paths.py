"""Where a save lands and what the file looks like after: symbolic links are written through
(atomically, in the target's directory), a directory, FIFO or device as the target fails before
anything is written, a replaced file keeps its mode and owner, a new one gets the umask's mode;
readers refuse a FIFO instead of blocking in ``open()``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._storage import publish

OTHER = 1000  # uid and gid of "another user"


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(257, 33, generator=g), "b": torch.randint(-(2**40), 2**40, (77,), generator=g),
            "step": seed}


def assert_loads(path: Path | str, seed: int) -> None:
    loaded, expected = ckptstream.load(path), make_state(seed)
    assert list(loaded) == list(expected)
    assert loaded["step"] == seed
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["b"], expected["b"])


def temps_under(*directories: Path) -> list[str]:
    return [e for d in directories for e in os.listdir(d) if publish.TEMP_MARK in e]


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths created by os.open while the test runs (O_CREAT)."""
    paths: list[str] = []
    real = os.open

    def fake(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            paths.append(os.fsdecode(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)
    return paths


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# --- symbolic links and non-files -------------------------------------------------------------


@pytest.mark.parametrize("relative", [False, True])
def test_a_symlink_is_written_through_atomically_in_its_targets_directory(
        tmp_path: Path, relative: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "store").mkdir()
    target, link = tmp_path / "store" / "ckpt-000100.safetensors", tmp_path / "runs" / "latest.safetensors"
    ckptstream.save(make_state(1), target)
    link.symlink_to(os.path.relpath(target, link.parent) if relative else target)
    renames: list[tuple[str, str]] = []
    real = os.replace

    def replace(a: str, b: str) -> None:
        renames.append((os.fsdecode(a), os.fsdecode(b)))
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    ckptstream.save(make_state(2), link)
    monkeypatch.undo()
    assert link.is_symlink()
    assert os.readlink(link) == (os.path.relpath(target, link.parent) if relative else str(target))
    assert_loads(target, 2)
    assert_loads(link, 2)
    [(src, dst)] = renames
    assert dst == str(target)
    assert os.path.dirname(src) == str(target.parent), "not replaced in the target's directory"
    assert temps_under(tmp_path / "runs", tmp_path / "store") == []


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link, target = tmp_path / "link.safetensors", tmp_path / "sub" / "new.safetensors"
    (tmp_path / "sub").mkdir()
    link.symlink_to(target)
    ckptstream.save(make_state(3), link)
    assert link.is_symlink()
    assert target.is_file()
    assert not target.is_symlink()
    assert_loads(target, 3)


def test_a_symlink_loop_is_refused(tmp_path: Path, created: list[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(OSError, match="loop") as info:
        ckptstream.save(make_state(1), a)
    assert info.value.errno == errno.ELOOP
    assert created == []


def test_a_directory_as_the_target_fails_before_anything_is_written(tmp_path: Path, created: list[str]) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    for given in (tmp_path / "ckpt", tmp_path / "link", f"{tmp_path / 'ckpt'}/"):
        with pytest.raises(IsADirectoryError) as info:
            ckptstream.save(make_state(1), given)
        assert info.value.filename == os.path.abspath(given)
        assert "directory" in str(info.value)
    assert created == [], "a file was created before the check"
    assert os.listdir(tmp_path / "ckpt") == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "link"]


def test_a_fifo_or_device_as_the_target_is_refused_before_writing(tmp_path: Path, created: list[str]) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    for given in (fifo, Path("/dev/null")):
        with pytest.raises(OSError, match="not a regular file") as info:
            ckptstream.save(make_state(1), given)
        assert info.value.filename == str(given)
    assert created == []
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_long_file_name_still_gets_a_temp(tmp_path: Path) -> None:
    """A temp's name adds a marker, the host, the namespace and the pid to the target's name:
    a target name near the file system's limit is shortened in it (with a hash of the whole)."""
    for name in ("x" * 250, "é" * 127):
        path = tmp_path / name
        ckptstream.save(make_state(4), path)
        ckptstream.save(make_state(5), path)
        assert_loads(path, 5)
    assert temps_under(tmp_path) == []
    a, b = (publish.temp_path_for(str(tmp_path / ("y" * 200 + end))) for end in "ab")
    assert a.rsplit("-", 4)[0] != b.rsplit("-", 4)[0], "two long names share their temps' prefix"


# --- mode and owner ---------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o002, 0o077])
def test_a_new_file_gets_the_mode_open_gives(tmp_path: Path, mask: int) -> None:
    data = torch.randint(0, 256, (10_001,), dtype=torch.uint8)
    with umask(mask):
        ckptstream.save(make_state(1), tmp_path / "ckpt.safetensors")
        ckptstream.device_to_file(data, tmp_path / "raw.bin")
        with open(tmp_path / "plain", "wb"):
            pass
    expected = 0o666 & ~mask
    for name in ("ckpt.safetensors", "raw.bin", "plain"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, (name, oct(expected))
    assert (tmp_path / "raw.bin").read_bytes() == data.numpy().tobytes()


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755, 0o444])
def test_a_replaced_file_keeps_its_mode(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(make_state(1), path)
    path.chmod(mode)
    with umask(0o022):
        ckptstream.save(make_state(2), path)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert_loads(path, 2)
    raw = tmp_path / "raw.bin"  # device_to_file writes in place: the same file, the same mode
    raw.write_bytes(b"old")
    raw.chmod(mode | 0o200)
    ckptstream.device_to_file(torch.arange(5, dtype=torch.uint8), raw)
    assert stat.S_IMODE(raw.stat().st_mode) == mode | 0o200
    assert raw.read_bytes() == bytes(range(5))


def test_a_replaced_file_keeps_its_owner(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path = tmp_path / "ckpt.safetensors"
    for mode in (0o600, 0o2750):  # a set-gid bit survives the change of owner too
        ckptstream.save(make_state(1), path)
        os.chown(path, OTHER, OTHER)
        path.chmod(mode)
        ckptstream.save(make_state(2), path)
        st = path.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OTHER, OTHER, mode)
        assert_loads(path, 2)
    assert temps_under(tmp_path) == []


# --- readers and FIFOs ------------------------------------------------------------------------


def run_unblocked(call: Callable[[], object], fifo: Path, reading: bool) -> BaseException | None:
    """Run ``call`` in a thread. If it is still blocked after a few seconds (an ``open()`` of the
    FIFO waiting for its other end), open that end so that it returns, and fail."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    if thread.is_alive():
        fd = os.open(fifo, (os.O_WRONLY if reading else os.O_RDONLY) | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
        pytest.fail(f"blocked in open() on the FIFO {fifo}")
    return outcome[0]


def test_readers_refuse_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    target = {"w": torch.empty(257, 33), "b": torch.empty(77, dtype=torch.int64), "step": 0}
    calls: dict[str, Callable[[], object]] = {
        "load": lambda: ckptstream.load(fifo),
        "open": lambda: ckptstream.open(fifo),
        "verify": lambda: ckptstream.verify(fifo),
        "load_into": lambda: ckptstream.load_into(target, fifo),
        "read_metadata": lambda: ckptstream.read_metadata(fifo),
        "file_to_device": lambda: ckptstream.file_to_device(fifo, torch.empty(10)),
    }
    for name, call in calls.items():
        error = run_unblocked(call, fifo, reading=True)
        assert isinstance(error, OSError), (name, error)
        assert error.filename == str(fifo), (name, error)
        assert "is a FIFO (named pipe), not a regular file" in str(error), (name, error)
    error = run_unblocked(lambda: ckptstream.device_to_file(torch.ones(10), fifo), fifo, reading=False)
    assert isinstance(error, OSError), error
    assert "is a FIFO (named pipe), not a regular file" in str(error), error
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_readers_refuse_a_directory(tmp_path: Path) -> None:
    for call in (ckptstream.load, ckptstream.verify, lambda p: ckptstream.file_to_device(p, torch.empty(3))):
        with pytest.raises(IsADirectoryError) as info:
            call(tmp_path)
        assert info.value.filename == str(tmp_path)
