"""``ckptstream verify`` of a DCP checkpoint against what its metadata records of each chunk: a
rank file of another save with the same layout (sound on its own, offsets alike) is not this
checkpoint's, by the CRC-32C the metadata records; a rank file that cannot be read is
unreadable (exit 2), not corrupt; errors of an object store are unreadable too."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream import cli
from ckptstream.cli import _dirs
from tests.dcp.dcp_helpers import save_1
from tests.helpers import child_env

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
RANK_FILE = "rank-00000.safetensors"


def dcp_save(folder: Path) -> None:
    save_1({"w": torch.randn(16, 8), "v": torch.randn(5), "step": 3}, folder)


def test_a_rank_file_of_another_save_with_the_same_layout_fails(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    dcp_save(tmp_path / "a")
    dcp_save(tmp_path / "b")  # other random values, the same keys, shapes and offsets
    ckptstream.verify(tmp_path / "b" / RANK_FILE)  # sound on its own
    with ckptstream.open(tmp_path / "a" / RANK_FILE) as a, ckptstream.open(tmp_path / "b" / RANK_FILE) as b:
        assert [(e.key, e.offset, e.end) for e in a.entries()] == [(e.key, e.offset, e.end) for e in b.entries()]
        crc = {e.key: e.checksum for e in a.entries()}
        other = {e.key: e.checksum for e in b.entries()}
    shutil.copyfile(tmp_path / "b" / RANK_FILE, tmp_path / "a" / RANK_FILE)
    status, out, err = cli.main(["verify", str(tmp_path / "a")]), *capsys.readouterr()
    assert (status, out) == (1, "")
    key = next(k for k in crc if k in err)
    assert (f"{tmp_path / 'a' / RANK_FILE}: chunk {key!r} has CRC-32C {other[key]:08x} in the file, but the "
            f"checkpoint's .metadata records {crc[key]:08x}: the file is from another save") in err


# Runs the command as a child whose root (where the tests run as root) has lost CAP_DAC_OVERRIDE
# and CAP_DAC_READ_SEARCH across exec (the bounding set), so that file modes hold for it too.
UNPRIVILEGED = """
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: refused without CAP_SETPCAP
            sys.exit(77)
os.execv(sys.executable, [sys.executable, "-m", "ckptstream.cli", *sys.argv[1:]])
"""


def test_an_unreadable_rank_file_is_unreadable_not_corrupt(tmp_path: Path) -> None:
    dcp_save(tmp_path / "a")
    rank_file = tmp_path / "a" / RANK_FILE
    rank_file.chmod(0)
    try:
        proc = subprocess.run([sys.executable, "-c", UNPRIVILEGED, "verify", str(tmp_path / "a")],
                              capture_output=True, text=True, timeout=120, env=child_env())
    finally:
        rank_file.chmod(0o644)
    if proc.returncode == 77:
        pytest.skip("root here cannot give up CAP_DAC_OVERRIDE (no CAP_SETPCAP): no file is unreadable to it")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert str(rank_file) in proc.stderr
    assert os.strerror(errno.EACCES) in proc.stderr


@pytest.mark.parametrize(("error", "status"), [
    (PermissionError(errno.EACCES, "Permission denied"), 2),
    (ckptstream.ConnectionLostError("s3://b/run/rank-00000.safetensors", "connection reset"), 2),
    (ckptstream.AccessDeniedError("s3://b/run/rank-00000.safetensors", "AccessDenied", "AccessDenied"), 2),
    (ckptstream.CorruptCheckpointError("bad"), 1),
    (ckptstream.TruncatedFileError("x", 0, 8, 4), 1),
    (ValueError("bad input"), 2),
], ids=["permission", "connection_lost", "access_denied", "corrupt", "truncated", "value"])  # fmt: skip
def test_the_status_of_an_error(error: Exception, status: int) -> None:
    """A request to an object store that failed is an OSError and a CkptStreamError both:
    the checkpoint was not read, so it is unreadable (2), never corrupt (1)."""
    assert _dirs.status_of(error) == status
