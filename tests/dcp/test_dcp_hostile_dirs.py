"""Hostile DCP checkpoint directories: chunks that name paths out of the directory, and a
``.metadata`` that is a FIFO, a directory, a socket, a device or a huge sparse file. Each is
refused with CorruptCheckpointError naming the file and what is wrong, by ``StreamReader``
(through ``dcp.load``) and by ``checkpoint_files()``, before anything outside the directory is
opened, and without blocking."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstream
import ckptstream.dcp
from ckptstream._storage import fileio as _fileio
from ckptstream.dcp import _metadata
from tests.dcp.dcp_helpers import (
    load_1,
    poisoned_like,
    raises_metadata_error,
    same_bits,
    save_1,
    single_process,
    worker_env,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
RANK0 = "rank-00000.safetensors"


def state() -> dict[str, Any]:
    return {"w": torch.randn(64, 5), "extra": {"step": 3}}


@contextlib.contextmanager
def opened_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every path os.open opens while the block runs (ckptstream opens every file through it)."""
    paths: list[str] = []
    real = os.open

    def traced(path: Any, *args: Any, **kwargs: Any) -> int:
        paths.append(os.path.abspath(os.fsdecode(path)))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", traced)
    try:
        yield paths
    finally:
        monkeypatch.undo()


def with_relative_path(ckpt: Path, name: str) -> None:
    """Rewrite the checkpoint's .metadata so that every chunk of the rank file is stored in ``name``."""
    metadata = _metadata.read_metadata(str(ckpt), None, trusted=False)
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=name) for k, v in metadata.storage_data.items()}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("kind", ["parent", "absolute", "subfolder", "empty", "dot", "dotdot", "nul"])
def test_chunk_paths_out_of_the_directory_are_refused(tmp_path: Path, kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the real rank file waits at each place the crafted name points to: without the
    check, the load would read it from there and succeed."""
    ckpt = tmp_path / "ckpt"
    save_1(state(), ckpt)
    for outside in (tmp_path / "secret", ckpt / "sub"):
        outside.mkdir()
        shutil.copy(ckpt / RANK0, outside / RANK0)
    name = {"parent": f"../secret/{RANK0}", "absolute": str(tmp_path / "secret" / RANK0), "subfolder": f"sub/{RANK0}",
            "empty": "", "dot": ".", "dotdot": "..", "nul": f"{RANK0}\0"}[kind]
    with_relative_path(ckpt, name)
    with opened_paths(monkeypatch) as paths:
        with pytest.raises(ckptstream.CorruptCheckpointError) as info:
            ckptstream.dcp.checkpoint_files(ckpt)
        raises_metadata_error(ckptstream.CorruptCheckpointError, "is not a file name in the checkpoint's directory",
                              load_1, state(), ckpt)
    assert str(info.value).startswith(f"{ckpt / '.metadata'}: the chunk of 'w' is stored in {name!r}, which is not "
                                      "a file name in the checkpoint's directory")
    assert paths  # the .metadata was opened
    assert [p for p in paths if not p.startswith(f"{ckpt}{os.sep}") or p.startswith(f"{ckpt / 'sub'}")] == []


def test_storage_info_of_filesystem_writer_is_checked_too(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    single_process(dcp.save, {"w": torch.randn(8)}, storage_writer=dcp.FileSystemWriter(ckpt))
    shutil.copy(ckpt / "__0_0.distcp", tmp_path / "__0_0.distcp")
    with_relative_path(ckpt, "../__0_0.distcp")
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"stored in '\.\./__0_0\.distcp', which is not a file"):
        ckptstream.dcp.checkpoint_files(ckpt)


def test_a_rank_file_may_be_a_link_to_elsewhere(tmp_path: Path) -> None:
    """A name is an entry of the directory, and that entry may be a symbolic link to a file
    elsewhere (as a Hugging Face cache links its snapshots' files to its blobs): the link is
    followed to read, and listed (and so deleted) as the link, inside the directory."""
    ckpt = tmp_path / "snapshot" / "ckpt"
    want = state()
    save_1(want, ckpt)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    os.replace(ckpt / RANK0, blobs / "0123abcd")
    os.symlink(os.path.relpath(blobs / "0123abcd", ckpt), ckpt / RANK0)
    loaded = load_1({"w": poisoned_like(want["w"]), "extra": {"step": 0}}, ckpt)
    assert same_bits(loaded["w"], want["w"])
    assert loaded["extra"] == {"step": 3}
    assert ckptstream.dcp.checkpoint_files(ckpt) == [str(ckpt / ".metadata"), str(ckpt / RANK0)]


# --- .metadata that is not a regular file ---------------------------------------------------------

CHILD = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp, ckptstream, ckptstream.dcp
warnings.simplefilter("ignore")
path = sys.argv[1]
try:
    ckptstream.dcp.checkpoint_files(path)
except ckptstream.CorruptCheckpointError as e:
    print("files:", e, flush=True)
reader = ckptstream.dcp.StreamReader(path)
try:
    reader.read_metadata()
except ckptstream.CorruptCheckpointError as e:
    print("reader:", e, flush=True)
try:
    dcp.load({"w": torch.zeros(64, 5)}, storage_reader=ckptstream.dcp.StreamReader(path), no_dist=True)
except BaseException as e:
    print("load:", type(e).__name__, flush=True)
print("done", flush=True)
"""


def test_a_fifo_metadata_does_not_block(tmp_path: Path) -> None:
    """In a child process: each entry point returns its error at once. (A read that opened the
    FIFO would wait for a writer for ever: the child would then be killed at the guard's
    deadline, which only decides how long a failure takes.)"""
    ckpt = tmp_path / "ckpt"
    save_1(state(), ckpt)
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ckpt)], env=worker_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    message = f"{ckpt / '.metadata'}: is a FIFO (named pipe), not a regular file"
    assert [line.split(":", 1)[0] for line in lines] == ["files", "reader", "load", "done"], proc.stdout
    assert all(message in line for line in lines[:2]), lines


@pytest.mark.parametrize("kind", ["directory", "socket", "character device"])
def test_metadata_that_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    ckpt = tmp_path / "ckpt"
    save_1(state(), ckpt)
    path = ckpt / ".metadata"
    path.unlink()
    with contextlib.ExitStack() as stack:
        if kind == "directory":
            path.mkdir()
        elif kind == "socket":
            sock = stack.enter_context(socket.socket(socket.AF_UNIX))
            sock.bind(str(path))
        else:
            os.symlink("/dev/zero", path)  # endless: a read of it would never finish
        with pytest.raises(ckptstream.CorruptCheckpointError, match=f"^{path}: .*{kind}.*DCP checkpoint's metadata "
                                                                    "is a regular file"):
            ckptstream.dcp.checkpoint_files(ckpt)
        raises_metadata_error(ckptstream.CorruptCheckpointError, kind, load_1, state(), ckpt)


def test_metadata_beyond_the_bound_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse .metadata larger than the bound is refused from its size (the bound made small
    here, so that the file is too)."""
    ckpt = tmp_path / "ckpt"
    save_1(state(), ckpt)
    monkeypatch.setattr(_metadata, "MAX_METADATA_BYTES", 1 << 20)
    os.truncate(ckpt / ".metadata", (1 << 20) + 1)
    reads: list[int] = []
    real = _fileio.pread_into

    def pread_into(fd: int, view: memoryview, *args: Any) -> int:
        reads.append(len(view))
        return real(fd, view, *args)

    monkeypatch.setattr(_fileio, "pread_into", pread_into)
    with pytest.raises(ckptstream.CorruptCheckpointError,
                       match=rf"^{ckpt / '.metadata'}: holds 1048577 bytes, more than the 1048576 expected"):
        ckptstream.dcp.checkpoint_files(ckpt)
    assert reads == []
