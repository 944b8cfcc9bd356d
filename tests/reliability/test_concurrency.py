"""Concurrent saves and loads: threads of one process saving at once, and a process loading a
path while another process saves over it again and again."""

from __future__ import annotations

import functools
import subprocess
import threading
from pathlib import Path
from typing import Any

from relutil import (
    MiB,
    all_temp_files,
    assert_released,
    assert_same_state,
    child_command,
    training_state,
)

import ckptstream

SIZE_MIB = 4
LOADS, VERSIONS = 20, 5  # the loads of the test below go on until they have seen this many


@functools.cache
def version_state(version: int) -> Any:
    return training_state(version, SIZE_MIB * MiB)


def run_threads(targets: list[Any]) -> None:
    """Start the callables together; re-raise the first failure."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def run(target: Any) -> None:
        barrier.wait()
        try:
            target()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_two_threads_save_different_states_at_once(tmp_path: Path) -> None:
    a, b = version_state(1), version_state(2)
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    small: dict[str, Any] = {"buffer_size": 256 * 1024, "num_buffers": 2}  # many chunks: the two saves interleave
    for _ in range(3):
        run_threads([lambda: ckptstream.save(a, pa, **small), lambda: ckptstream.save(b, pb, **small)])
        for path, state in ((pa, a), (pb, b)):
            ckptstream.verify(path)
            assert_same_state(ckptstream.load(path), state)
    # and loads running beside saves
    pc = tmp_path / "c.safetensors"
    loaded: dict[str, Any] = {}
    run_threads([lambda: ckptstream.save(a, pc, **small), lambda: loaded.update(b=ckptstream.load(pb, **small)),
                 lambda: ckptstream.verify(pa)])  # fmt: skip
    assert_same_state(loaded["b"], b)
    assert_same_state(ckptstream.load(pc), a)
    assert_released()
    assert all_temp_files(tmp_path) == []


def test_threads_saving_over_one_path_leave_one_complete_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    states = [version_state(v) for v in range(4)]
    run_threads([functools.partial(ckptstream.save, s, path, buffer_size=256 * 1024) for s in states])
    loaded = ckptstream.load(path)
    assert_same_state(loaded, states[loaded["meta"]["version"]])
    ckptstream.verify(path)
    assert all_temp_files(tmp_path) == []


def test_loading_while_another_process_saves_over_the_path(tmp_path: Path) -> None:
    """Loads of a path that another process saves over again and again see complete versions,
    never older than the last seen; the writer goes on until the loads have seen enough."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(version_state(0), path)
    writer = subprocess.Popen(child_command("child_saver_loop.py", path, 1, SIZE_MIB), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert writer.stdin is not None
    assert writer.stdout is not None
    try:
        assert writer.stdout.readline().strip() == "ready"
        seen: list[int] = []
        while len(seen) < LOADS or len(set(seen)) < VERSIONS:
            assert writer.poll() is None, "the writer stopped"
            state = ckptstream.load(path)  # verify=True: every tensor checked against its checksum
            version = state["meta"]["version"]
            assert_same_state(state, version_state(version))
            assert not seen or version >= seen[-1], "versions went backwards"
            seen.append(version)
            if len(seen) % 10 == 0:
                ckptstream.verify(path)
        writer.stdin.write("stop\n")
        writer.stdin.close()
        last = int(writer.stdout.readline().split()[1])
        assert writer.wait(timeout=120) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        writer.stdout.close()
    assert last >= seen[-1]
    assert_same_state(ckptstream.load(path), version_state(last))
    assert all_temp_files(tmp_path) == []
