"""A save that runs out of room (file size limit: EFBIG; a full file system: ENOSPC) raises
OSError with the errno and the file, leaves the previous checkpoint byte-identical and no temp
file, and the process can go on saving elsewhere."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from tests.reliability.relutil import (
    KiB,
    MiB,
    all_temp_files,
    assert_released,
    assert_same_state,
    fd_count,
    run_child,
    small_state,
)


def assert_names_the_file(e: OSError, path: Path) -> None:
    """The error names the file being written: the temp file beside ``path`` (its directory and
    name are in it), or ``path`` itself."""
    assert e.filename is not None, f"no file named in {e!r}"
    name = os.path.basename(e.filename)
    assert os.path.dirname(e.filename) == str(path.parent), e.filename
    assert name == path.name or name.startswith(f".{path.name}.ckptstream-tmp-"), e.filename


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_file_size_limit_efbig(tmp_path: Path, direct: str) -> None:
    report = json.loads(run_child("child_fsize.py", tmp_path, direct).stdout)
    err = report["save"]
    assert err is not None, "save did not fail beyond RLIMIT_FSIZE"
    assert (err["type"], err["errno"]) == ("OSError", errno.EFBIG), err
    e = OSError(err["errno"], "", err["filename"])
    assert_names_the_file(e, tmp_path / "ckpt.safetensors")
    assert report["unchanged"], "the previous checkpoint changed"
    assert report["temps"] == [], "a temp file was left behind"
    assert (report["pool_in_use"], report["threads"], report["fds_leaked"]) == (0, [], 0)
    raw = report["device_to_file"]
    assert raw is not None
    assert raw["errno"] == errno.EFBIG, raw
    assert raw["filename"] == str(tmp_path / "raw.bin"), raw
    assert report["recovered"]


def _run(*cmd: str) -> str | None:
    """None on success, else why it failed."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]}: {e}"
    return None if proc.returncode == 0 else f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}"


@pytest.fixture(params=["tmpfs", "ext4-loop"])
def full_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted 4 MiB file system (tmpfs, or ext4 on a loop device, which takes
    O_DIRECT); skipped where this machine does not let the tests mount one (not root, no
    loop devices, a container without CAP_SYS_ADMIN)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    if request.param == "tmpfs":
        why = _run("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt))
    else:
        image = tmp_path / "fs.img"
        with open(image, "wb") as f:
            f.truncate(6 * MiB)
        why = _run("mkfs.ext4", "-q", "-F", str(image)) or _run("mount", "-o", "loop", str(image), str(mnt))
    if why is not None:
        pytest.skip(f"cannot mount a small {request.param} here: {why}")
    try:
        yield mnt
    finally:
        assert _run("umount", str(mnt)) is None


def test_full_file_system_enospc(full_fs: Path, tmp_path: Path) -> None:
    path = full_fs / "ckpt.safetensors"
    old = small_state(1, scale=64)  # ~100 KiB
    big: dict[str, Any] = {"w": torch.arange(2 << 20, dtype=torch.float32), "step": 1}  # 8 MiB: more than the fs holds
    ckptstream.save(old, path)
    before = path.read_bytes()
    ckptstream.load(path)  # first use of everything, before counting descriptors
    fds = fd_count()
    errors = []
    for _ in range(3):  # again and again: nothing accumulates
        with pytest.raises(OSError, match="No space left on device") as info:
            ckptstream.save(big, path, settings=ckptstream.Settings(buffer_size=256 * KiB))
        errors.append(str(info.value))
        assert info.value.errno == errno.ENOSPC, info.value
        assert_names_the_file(info.value, path)
        assert path.read_bytes() == before
        assert all_temp_files(full_fs) == [], "a temp file was left behind"
        assert_released()
        assert fd_count() == fds
    assert_same_state(ckptstream.load(path), old)
    # the space the failed save used is free again: saving elsewhere works, on this file system and another
    ckptstream.save(old, full_fs / "other.safetensors")
    assert_same_state(ckptstream.load(full_fs / "other.safetensors"), old)
    ckptstream.save(big, tmp_path / "big.safetensors")
    assert_same_state(ckptstream.load(tmp_path / "big.safetensors"), big)
    # the error said how much room the checkpoint needs: the size of the file it makes elsewhere
    needs = f"the checkpoint {path} needs {(tmp_path / 'big.safetensors').stat().st_size} bytes"
    assert all(needs in error for error in errors), errors
