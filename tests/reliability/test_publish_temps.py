"""Leftover temp files of killed writers: a save removes those whose writers are certainly gone
(this host by its exact name, this PID namespace, the process gone; or untouched for
``STALE_AFTER_S``) and nothing else, and never fails because a leftover cannot be removed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream._storage import publish
from ckptstream._storage.local import LOCAL

DEAD_PID = 4_194_304 + 1  # past the largest pid_max Linux allows: never a process
NOBODY, OTHER = 65534, 1000  # uids of the sticky-directory test


def temp_name(path: Path, host: str | None = None, ns: int | None = None, pid: int = DEAD_PID) -> str:
    host = socket.gethostname() if host is None else host
    ns = publish.pid_namespace() if ns is None else ns
    return f".{path.name}{publish.TEMP_MARK}{host}-{ns}-{pid}-0123456789ab"


def leave(directory: Path, *names: str, age_s: float = 0) -> None:
    for name in names:
        (directory / name).write_bytes(b"partial")
        if age_s:
            t = time.time() - age_s
            os.utime(directory / name, (t, t))


def save_small(path: Path) -> dict[str, torch.Tensor]:
    state = {"w": torch.randn(1000), "i": torch.randint(-(2**40), 2**40, (37,))}
    ckptstream.save(state, path)
    loaded = ckptstream.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    return state


def test_parsing_the_temp_name_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host ``vm`` removes its own dead writer's temp, never one of host ``vm-99999`` (nor
    ``vm-1``, ``xvm``, ``VM``), one of another PID namespace, or a name it does not make."""
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    path = tmp_path / "ckpt.safetensors"
    ns = publish.pid_namespace()
    assert ns, "this test needs /proc/self/ns/pid"
    own = temp_name(path, "vm")
    kept = [temp_name(path, host) for host in ("vm-99999", "vm-1", "xvm", "VM", "")]
    kept += [temp_name(path, "vm", ns + 1), temp_name(path, "vm", 0),
             f".{path.name}{publish.TEMP_MARK}vm-{DEAD_PID}-0123456789ab",  # no namespace in it
             f".{path.name}{publish.TEMP_MARK}vm-{ns}-{DEAD_PID}-0123456789abc",
             f".{path.name}{publish.TEMP_MARK}vm-{ns}-{DEAD_PID}",
             temp_name(tmp_path / "other.safetensors", "vm"), f"{path.name}.bak"]
    leave(tmp_path, own, *kept)
    assert temp_name(path, "vm-99999").startswith(f".{path.name}{publish.TEMP_MARK}vm-")  # a prefix match's trap
    save_small(path)
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, path.name])


def test_a_live_writer_keeps_its_temp_also_another_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.kill(pid, 0)`` raising PermissionError means the process exists (another user's):
    its temp stays. ProcessLookupError means gone: its temp goes."""
    path = tmp_path / "ckpt.safetensors"
    other_user, gone, this = temp_name(path, pid=4242), temp_name(path, pid=4343), temp_name(path, pid=os.getpid())
    leave(tmp_path, other_user, gone, this)
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        if pid == 4242:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        if pid == 4343:
            raise ProcessLookupError(errno.ESRCH, os.strerror(errno.ESRCH))
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    save_small(path)
    assert sorted(os.listdir(tmp_path)) == sorted([other_user, this, path.name])


def test_temps_untouched_for_a_day_are_removed_whoever_wrote_them(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    day = publish.STALE_AFTER_S
    old = [temp_name(path, "elsewhere", pid=7), temp_name(path, ns=1, pid=os.getpid()),
           f".{path.name}{publish.TEMP_MARK}elsewhere-7-0123456789ab"]
    recent = [temp_name(path, "elsewhere2", pid=7), temp_name(path, ns=1, pid=8)]
    not_ours = [f".{path.name}{publish.TEMP_MARK}notes.txt", f"{path.name}.old"]
    leave(tmp_path, *old, age_s=day + 60)
    leave(tmp_path, *recent, age_s=day - 60)
    leave(tmp_path, *not_ours, age_s=10 * day)
    save_small(path)
    assert sorted(os.listdir(tmp_path)) == sorted([*recent, *not_ours, path.name])


def test_cleanup_that_fails_never_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    stale = temp_name(path)
    leave(tmp_path, stale)
    real_unlink = os.unlink

    def unlink(p: object, *args: object, **kwargs: object) -> None:
        if os.path.basename(os.fsdecode(p)) == stale:  # type: ignore[arg-type]
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), p)
        real_unlink(p, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    save_small(path)
    assert sorted(os.listdir(tmp_path)) == sorted([stale, path.name])


@pytest.fixture
def sticky_dir() -> Iterator[Path]:
    """A 1777 directory that other users can reach (tmp_path's parents are private to root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to make a file of another user and to switch users")
    directory = Path(tempfile.mkdtemp(prefix="ckptstream-sticky-"))
    try:
        directory.chmod(0o1777)
        parents = [directory.parent, *directory.parent.parents]
        if any(p.stat().st_mode & 0o001 == 0 for p in parents):
            pytest.skip(f"{directory.parent} is not reachable by other users")
        yield directory
    finally:
        shutil.rmtree(directory)


def test_a_leftover_of_another_user_in_a_sticky_directory(sticky_dir: Path) -> None:
    """uid 65534 saves where a stale temp of uid 1000's lies: it cannot remove it (sticky bit),
    and saves anyway. A forked child switches users and publishes through ``atomic_file``."""
    path = sticky_dir / "ckpt.safetensors"
    theirs = temp_name(path, pid=DEAD_PID)
    leave(sticky_dir, theirs, age_s=2 * publish.STALE_AFTER_S)
    os.chown(sticky_dir / theirs, OTHER, OTHER)
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only publishes
        pid = os.fork()
    if pid == 0:  # the child: no torch, no threads; reports through its exit status and the pipe
        code = 1
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with LOCAL.create(str(path)) as f:
                os.pwrite(f.fd, b"new checkpoint", 0)
            code = 0
        except BaseException as e:
            os.write(write, repr(e).encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        error = r.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the save of another user failed: {error}"
    assert path.read_bytes() == b"new checkpoint"
    assert path.stat().st_uid == NOBODY
    assert sorted(os.listdir(sticky_dir)) == sorted([theirs, path.name])


CHILD = textwrap.dedent("""
    import json, os, sys
    from ckptstream._storage import publish
    from ckptstream._storage.local import LOCAL
    path, live = sys.argv[1], sys.argv[2]
    own_dead = os.path.join(os.path.dirname(path), os.path.basename(live).rsplit("-", 3)[0]
                            + f"-{publish.pid_namespace()}-30000-0123456789ab")
    open(own_dead, "wb").close()
    with LOCAL.create(path) as f:
        os.pwrite(f.fd, b"from the child", 0)
    print(json.dumps({"pid": os.getpid(), "ns": publish.pid_namespace(), "own_dead": os.path.basename(own_dead)}))
""")


def test_a_writer_in_another_pid_namespace_keeps_our_live_temp(tmp_path: Path) -> None:
    """A save in its own PID namespace (same host name) does not take this live process's temp
    for a dead one, and still removes a dead writer's temp of its own namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.strip()}")
    path = tmp_path / "ckpt.safetensors"
    with LOCAL.create(str(path)) as f:  # a live save of this process, its temp open
        live = os.readlink(f"/proc/self/fd/{f.fd}")
        os.pwrite(f.fd, b"from the parent", 0)
        child = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", CHILD, str(path), live],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        report = json.loads(child.stdout)
        assert report["ns"] != publish.pid_namespace()
        assert report["pid"] < 100
        assert os.path.exists(live), "the child removed a live writer's temp"
        assert not os.path.exists(tmp_path / report["own_dead"]), "a dead temp of the child's namespace stayed"
        assert path.read_bytes() == b"from the child"
    assert path.read_bytes() == b"from the parent"
    assert sorted(os.listdir(tmp_path)) == [path.name]
