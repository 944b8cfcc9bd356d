"""Concurrent saves and loads: threads of one process saving at once, and a process loading a
path while another process saves over it again and again."""

from __future__ import annotations

import functools
import subprocess
import threading
from pathlib import Path
from typing import Any

import ckptstream
from ckptstream import Settings
from tests.helpers import child_env
from tests.reliability.relutil import (
    MiB,
    all_temp_files,
    assert_released,
    assert_same_state,
    child_command,
    training_state,
)

SAVES = 12
SIZE_MIB = 4


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
    small = Settings(buffer_size=256 * 1024, num_buffers=2)  # many chunks: the two saves interleave
    for _ in range(3):
        run_threads([lambda: ckptstream.save(a, pa, settings=small), lambda: ckptstream.save(b, pb, settings=small)])
        for path, state in ((pa, a), (pb, b)):
            ckptstream.verify(path)
            assert_same_state(ckptstream.load(path), state)
    # and loads running beside saves
    pc = tmp_path / "c.safetensors"
    loaded: dict[str, Any] = {}
    run_threads([lambda: ckptstream.save(a, pc, settings=small),
                 lambda: loaded.update(b=ckptstream.load(pb, settings=small)),
                 lambda: ckptstream.verify(pa)])  # fmt: skip
    assert_same_state(loaded["b"], b)
    assert_same_state(ckptstream.load(pc), a)
    assert_released()
    assert all_temp_files(tmp_path) == []


def test_threads_saving_over_one_path_leave_one_complete_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    states = [version_state(v) for v in range(4)]
    chunked = Settings(buffer_size=256 * 1024)
    run_threads([functools.partial(ckptstream.save, s, path, settings=chunked) for s in states])
    loaded = ckptstream.load(path)
    assert_same_state(loaded, states[loaded["meta"]["version"]])
    ckptstream.verify(path)
    assert all_temp_files(tmp_path) == []


def test_loading_while_another_process_saves_over_the_path(tmp_path: Path) -> None:
    """Another process saves versions 1..SAVES over the path, in step with this one: for each
    version this process loads the path while the new file is written but not yet renamed (the
    old version, also from a reader opened then and read after the rename), again as the rename
    happens (either version, whole), and once the save has returned (the new version)."""
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(version_state(0), path)
    writer = subprocess.Popen(child_command("child_saver_loop.py", path, 1, SAVES, SIZE_MIB), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    commands, replies = writer.stdin, writer.stdout
    assert commands is not None
    assert replies is not None

    def hear(expected: str) -> None:
        line = replies.readline().strip()
        assert line == expected, f"the writer said {line!r}, expected {expected!r}"

    def say(word: str) -> None:
        commands.write(word + "\n")
        commands.flush()

    def load() -> int:
        state = ckptstream.load(path)  # every tensor checked against its checksum
        version: int = state["meta"]["version"]
        assert_same_state(state, version_state(version))
        return version

    seen: list[int] = []
    try:
        hear("ready")
        for version in range(1, SAVES + 1):
            say("go")
            hear(f"written {version}")
            seen.append(load())
            assert seen[-1] == version - 1, "a load saw a file that was not published yet"
            with ckptstream.open(path) as before_the_rename:
                say("publish")
                seen.append(load())  # as the rename happens: the old or the new file, whole
                assert_same_state(before_the_rename.load(), version_state(version - 1))
            hear(f"saved {version}")
            seen.append(load())
            assert seen[-1] == version
            assert seen == sorted(seen), f"versions went backwards: {seen}"
            if version % 10 == 0:
                ckptstream.verify(path)
        commands.close()
        assert writer.wait(timeout=120) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        replies.close()
    assert len(seen) == 3 * SAVES
    assert_same_state(ckptstream.load(path), version_state(SAVES))
    assert all_temp_files(tmp_path) == []
