"""Two CheckpointManagers writing one s3:// prefix as the same rank, on a real S3 server. S3 has
no lock that a dead holder releases: the manager keeps the newest writer's record there
(``.lock-rank-NNNNN``: host, pid, start, a random id), checked before each save and before each
DONE. A manager whose record another has replaced gets DirectoryLockedError naming that one,
and its step is not counted; the other goes on. In one process and in two."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from tests.helpers import child_env
from tests.s3.s3util import Bucket, s3_server  # noqa: F401
from tests.s3.s3util import s3 as bucket  # noqa: F401

HERE = Path(__file__).parent
RECORD = "run/ckpts/.lock-rank-00000"


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)  # as child_s3_writer.py's
    return {"w": torch.randn(5000, generator=g), "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and torch.equal(a["w"], b["w"]) and a["step"] == b["step"]


def test_a_manager_taken_over_on_a_prefix_is_refused_naming_the_other(bucket: Bucket) -> None:
    directory = bucket.url("run/ckpts")
    first, second = ckptstream.CheckpointManager(directory, keep=None), ckptstream.CheckpointManager(directory,
                                                                                                      keep=None)
    first.save(state(1), 1, blocking=True)
    mine = json.loads(bucket.get(RECORD))
    second.save(state(2), 2, blocking=True)  # its record replaces the first's
    record = json.loads(bucket.get(RECORD))
    assert (record["pid"], record["host"]) == (mine["pid"], mine["host"]) == (os.getpid(), socket.gethostname())
    assert record["id"] != mine["id"]
    for write in (lambda: first.save(state(3), 3), lambda: first.delete(1)):
        with pytest.raises(ckptstream.DirectoryLockedError) as info:
            write()
        assert info.value.holder == record
        assert info.value.rank == 0
        message = str(info.value)
        for part in (directory, "as rank 0 since this one started", f"process {os.getpid()} on host "
                     f"{socket.gethostname()!r}", RECORD, "One manager writes as a rank of a directory at a time"):
            assert part in message, message
    assert first.steps() == [1, 2]
    assert same(second.load(2), state(2))
    assert same(second.load(1), state(1))
    second.save(state(3), 3, blocking=True)
    first.close()
    assert json.loads(bucket.get(RECORD)) == record  # not the first's to remove
    second.close()
    assert RECORD not in bucket.keys("run/")
    assert [k for k in bucket.keys("run/") if k.endswith("/DONE")] == [f"run/ckpts/step-00000000000{s}/DONE"
                                                                  for s in (1, 2, 3)]


def test_a_save_in_flight_when_another_takes_over_is_not_counted(bucket: Bucket,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The record is looked at once more right before DONE: another writer's record put there
    while the save streamed fails the save, and its step gets no DONE."""
    directory = bucket.url("run/ckpts")
    ckpts = ckptstream.CheckpointManager(directory)
    ckpts.save(state(1), 1, blocking=True)
    other = {"host": "elsewhere", "pid": 4242, "since": "2026-01-01T00:00:00", "id": os.urandom(8).hex()}
    ranks = ckpts._ranks
    agree = ranks.complete

    def taken_over_meanwhile(step: int, error: BaseException | None, publish: Any) -> None:
        bucket.put(RECORD, json.dumps(other).encode())  # the other manager starts while this one's file uploads
        agree(step, error, publish)

    monkeypatch.setattr(ranks, "complete", taken_over_meanwhile)
    handle = ckpts.save(state(2), 2)
    with pytest.raises(ckptstream.DirectoryLockedError, match="process 4242 on host 'elsewhere'") as info:
        handle.result()
    assert info.value.holder == other
    assert ckpts.steps() == [1]
    assert "run/ckpts/step-000000000002/DONE" not in bucket.keys("run/")
    ckpts.close()
    assert json.loads(bucket.get(RECORD)) == other


@pytest.mark.timeout(180)
def test_two_processes_on_one_prefix(bucket: Bucket) -> None:
    """A manager in another process saves step 1; this one then saves step 2 (taking the record
    over); the other's next save is refused, naming this process."""
    directory = bucket.url("run/ckpts")
    with subprocess.Popen([sys.executable, str(HERE / "child_s3_writer.py"), directory], env=child_env(),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdin is not None
            assert child.stdout.readline() == "saved\n"
            assert json.loads(bucket.get(RECORD))["pid"] == child.pid
            with ckptstream.CheckpointManager(directory, keep=None) as ckpts:
                ckpts.save(state(2), 2, blocking=True)
                child.stdin.write("go\n")
                child.stdin.flush()
                out, err = child.communicate(timeout=150)
                assert child.returncode == 0, err
                report = json.loads(out.strip().splitlines()[-1])
                assert report["result"] == "DirectoryLockedError", report
                assert (report["holder"]["pid"], report["holder"]["host"], report["rank"]) == (
                    os.getpid(), socket.gethostname(), 0)
                assert f"process {os.getpid()} on host {socket.gethostname()!r}" in report["message"]
                assert report["steps"] == [1, 2]
                ckpts.save(state(3), 3, blocking=True)
                assert ckpts.steps() == [1, 2, 3]
                for step in (1, 2, 3):
                    assert same(ckpts.load(step), state(step))
        finally:
            child.kill()
