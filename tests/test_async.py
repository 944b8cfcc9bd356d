"""save_async: the file of the moment of the call in every mode, errors never lost,
backpressure, exit with a save in flight, and (marked ``gpu``) the order of CUDA work."""

from __future__ import annotations

import dataclasses
import errno
import gc
import json
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._checkpoint import capture, save, save_async, snapshot
from ckptstream._engine import control
from ckptstream._engine.write import WriteEngine
from tests.helpers import engine_threads, random_tensor
from tests.resume.trainutil import detached, differences, run_child, start_child

pytestmark = pytest.mark.usefixtures("no_save_left_behind")
MODES = ["device", "lazy", "host"]
SLOW: dict[str, Any] = {"buffer_size": 64 << 10, "num_buffers": 2, "io_threads": 1}  # many chunks: a slow save



@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk takes 2 ms longer to write: a save is still streaming when the test acts."""
    real = WriteEngine._write

    def slowed(self: WriteEngine, chunk: Any, buf: Any) -> None:
        time.sleep(0.002)
        real(self, chunk, buf)

    monkeypatch.setattr(WriteEngine, "_write", slowed)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background saves start writing only once the returned event is set."""
    opened = threading.Event()
    real = save.write_checkpoint

    def gated(*args: Any, **kwargs: Any) -> None:
        assert opened.wait(30), "the test never opened the gate"
        real(*args, **kwargs)

    monkeypatch.setattr(save_async, "write_checkpoint", gated)
    yield opened
    opened.set()


def fail_writes(monkeypatch: pytest.MonkeyPatch, at_chunk: int = 2) -> None:
    """The write engine fails with ENOSPC at its ``at_chunk``-th chunk (0-based)."""
    real = WriteEngine._write
    count = [0]

    def failing(self: WriteEngine, chunk: Any, buf: Any) -> None:
        count[0] += 1
        if count[0] > at_chunk:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self.file.name)
        real(self, chunk, buf)

    monkeypatch.setattr(WriteEngine, "_write", failing)


def training_state(big: int = 1 << 21) -> dict[str, Any]:
    """A training-like state: a large weight, a non-contiguous view, bf16, a 0-d CPU step, an
    empty tensor, shared storage and plain leaves."""
    w = random_tensor((big // 64, 64))
    return {
        "model": {"w": w, "w_t": w.t(), "b": random_tensor(33, torch.bfloat16), "empty": torch.empty(0, 3)},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": random_tensor((100, 7))}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]},
        "rng": torch.get_rng_state(),
        "step": 7,
    }


def mutate(state: dict[str, Any]) -> None:
    """Change every part of ``training_state`` in place, as the next training step would."""
    with torch.no_grad():
        state["model"]["w"].add_(1.0)
        state["model"]["b"].mul_(-1)
        state["optim"]["state"][0]["step"].add_(1)
        state["optim"]["state"][0]["exp_avg"].zero_()
        state["rng"].zero_()
    state["optim"]["param_groups"][0]["lr"] = 0.05
    state["step"] = 8


@pytest.mark.parametrize("mode", MODES)
def test_the_file_is_what_save_writes(mode: str, tmp_path: Path) -> None:
    state = training_state(1 << 16)
    handle = ckptstream.save_async(state, tmp_path / "async.safetensors", mode=mode, metadata={"run": "a"},
                                   settings=Settings(buffer_size=8192, num_buffers=3))
    assert handle.path == str(tmp_path / "async.safetensors")
    assert handle.mode == mode
    assert handle.step is None
    handle.wait_staged()
    assert handle.result() == handle.path
    assert handle.done()
    assert handle.staged()
    assert engine_threads() == []  # the save's own thread is joined too
    assert handle.seconds_to_staged is not None
    assert handle.seconds_to_durable is not None
    assert 0 <= handle.seconds_to_staged <= handle.seconds_to_durable
    assert ckptstream.read_metadata(handle.path) == {"run": "a"}
    ckptstream.save(state, tmp_path / "sync.safetensors", metadata={"run": "a"})
    assert (tmp_path / "async.safetensors").read_bytes() == (tmp_path / "sync.safetensors").read_bytes()
    assert [p.name for p in tmp_path.iterdir() if ".ckptstream-tmp-" in p.name] == []


@pytest.mark.parametrize("mode", MODES)
def test_changes_after_the_call_are_not_in_the_file(mode: str, tmp_path: Path, slow_writes: None) -> None:
    """"device" and "host": the state may change as soon as the call returns; "lazy": once
    wait_staged() returns, and its small CPU tensors and plain values at once."""
    state = training_state()
    expected = detached(state)
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode=mode, settings=Settings(**SLOW))
    if mode == "lazy":
        state["optim"]["state"][0]["step"].add_(1)  # a CPU step counter, changed before the gate
        state["step"] = 99
        state["optim"]["param_groups"][0]["lr"] = 9.0
        assert not handle.done()
        handle.wait_staged()
    mutate(state)
    assert handle.result() == str(tmp_path / "ckpt.safetensors")
    assert differences(ckptstream.load(handle.path), expected) == []


def test_lazy_mode_captures_cpu_tensors_of_up_to_1_mib_at_the_call(tmp_path: Path, gate: threading.Event) -> None:
    """"lazy": a 512 KiB CPU tensor, an RNG state and a tensor of exactly 1 MiB changed right
    after the call, before wait_staged() (the save is held back from writing meanwhile), are saved
    with their values at the call; a CPU tensor one element over 1 MiB streams from the live
    tensor, as documented (changed before wait_staged(), its new values are saved)."""
    over = capture.BY_VALUE_BYTES // 4 + 1
    state = {"half_mib": random_tensor(128 << 10), "rng": torch.get_rng_state(),
             "one_mib": random_tensor(capture.BY_VALUE_BYTES // 4), "over": random_tensor(over)}
    expected = detached(state)
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="lazy")
    assert handle.mode == "lazy"
    assert not handle.staged()
    state["half_mib"].mul_(-1)
    torch.rand(100)  # the generator moves on, and its state is read back into the same tensor
    state["rng"].copy_(torch.get_rng_state())
    state["one_mib"].add_(1)
    state["over"].add_(1)
    assert not torch.equal(state["rng"], expected["rng"])
    gate.set()
    handle.wait_staged()
    handle.result()
    loaded = ckptstream.load(handle.path)
    assert differences({k: loaded[k] for k in ("half_mib", "rng", "one_mib")},
                       {k: expected[k] for k in ("half_mib", "rng", "one_mib")}) == []
    assert torch.equal(loaded["over"], state["over"])  # streamed live


def test_a_failed_save_raises_at_result_and_leaves_the_old_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"old": torch.arange(5)}, path)
    old = path.read_bytes()
    fail_writes(monkeypatch)
    handle = ckptstream.save_async(training_state(), path, settings=Settings(**SLOW))
    handle.wait_staged()  # a failed save counts as staged: the state is no longer read
    with pytest.raises(OSError, match="No space left") as e:
        handle.result()
    assert e.value.errno == errno.ENOSPC
    assert handle.done()
    assert handle.seconds_to_durable is None
    with pytest.raises(OSError, match="No space left"):
        handle.result()  # asked again, it says the same
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
    monkeypatch.undo()
    ckptstream.save_async({"new": torch.arange(3)}, path).result()  # collected: nothing raised here
    assert torch.equal(ckptstream.load(path)["new"], torch.arange(3))


def test_an_uncollected_error_is_raised_by_the_next_save_async(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fail_writes(monkeypatch)
    failed = ckptstream.save_async(training_state(), tmp_path / "a.safetensors", settings=Settings(**SLOW))
    while not failed.done():
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(ckptstream.CheckpointNotSavedError, match=r"a\.safetensors.*No space left") as e:
        ckptstream.save_async({"x": torch.ones(3)}, tmp_path / "b.safetensors")
    assert isinstance(e.value, RuntimeError)
    assert isinstance(e.value.__cause__, OSError)
    assert "b.safetensors was not started" in str(e.value)
    assert not (tmp_path / "b.safetensors").exists()
    assert save_async.in_flight() == []
    ckptstream.save_async({"x": torch.ones(3)}, tmp_path / "b.safetensors").result()  # raised once only


def test_one_save_in_flight_then_the_next_call_waits(tmp_path: Path, gate: threading.Event) -> None:
    first = ckptstream.save_async({"a": torch.arange(10)}, tmp_path / "a.safetensors")
    returned = threading.Event()
    second: list[ckptstream.SaveHandle] = []

    def call() -> None:
        second.append(ckptstream.save_async({"b": torch.arange(4)}, tmp_path / "b.safetensors"))
        returned.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert not returned.wait(0.3)
    assert not first.done()
    gate.set()
    caller.join(30)
    assert returned.is_set()
    assert first.done()
    assert second[0].result()
    assert first.result()


def test_max_in_flight_lets_saves_overlap(tmp_path: Path, gate: threading.Event) -> None:
    handles = [ckptstream.save_async({"t": torch.full((3,), float(i))}, tmp_path / f"{i}.safetensors",
                                     max_in_flight=3) for i in range(3)]
    assert not any(h.done() for h in handles)
    assert len(save_async.in_flight()) == 3
    gate.set()
    for i, h in enumerate(handles):
        assert torch.equal(ckptstream.load(h.result())["t"], torch.full((3,), float(i)))


def test_timeouts(tmp_path: Path, gate: threading.Event) -> None:
    handle = ckptstream.save_async({"t": torch.ones(3)}, tmp_path / "t.safetensors", mode="lazy")
    with pytest.raises(TimeoutError, match="not staged within"):
        handle.wait_staged(timeout=0.05)
    with pytest.raises(TimeoutError, match="did not finish within"):
        handle.result(timeout=0.05)
    assert "staging" in repr(handle)
    gate.set()
    handle.result(timeout=30)
    assert "durable" in repr(handle)


@pytest.mark.parametrize("bad", ["object_leaf", "missing_directory", "mode", "max_in_flight"])
def test_bad_input_raises_before_anything_starts(bad: str, tmp_path: Path) -> None:
    state: dict[str, Any] = {"t": torch.ones(3)}
    path, kwargs = tmp_path / "x.safetensors", dict[str, Any]()
    expected: type[Exception] = ValueError
    if bad == "object_leaf":
        state["o"], expected = object(), ckptstream.UnsupportedTypeError
    elif bad == "missing_directory":
        path, expected = tmp_path / "nope" / "x.safetensors", FileNotFoundError
    elif bad == "mode":
        kwargs = {"mode": "gpu"}
    else:
        kwargs = {"max_in_flight": 0}
    with pytest.raises(expected):
        ckptstream.save_async(state, path, **kwargs)
    assert save_async.in_flight() == []
    assert engine_threads() == []
    assert list(tmp_path.iterdir()) == []


def test_device_mode_short_of_memory_streams_the_live_state_before_returning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_writes: None) -> None:
    monkeypatch.setattr(capture, "_device_snapshot", lambda tensors: None)  # as when the GPU is full
    state = training_state()
    expected = detached(state)
    with pytest.warns(ckptstream.SnapshotFallbackWarning, match="too little free GPU memory") as record:
        handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", settings=Settings(**SLOW))
    assert record[0].filename == __file__
    assert handle.mode == "lazy"
    assert handle.staged()
    mutate(state)
    handle.result()
    assert differences(ckptstream.load(handle.path), expected) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptstream.SnapshotFallbackWarning)  # to refuse the stall
        with pytest.raises(ckptstream.SnapshotFallbackWarning):
            ckptstream.save_async(state, tmp_path / "refused.safetensors")
    assert save_async.in_flight() == []
    assert not (tmp_path / "refused.safetensors").exists()


# --- saves of one path ---------------------------------------------------------------------


@dataclasses.dataclass
class HeldSave:
    """The first background save of a test, held back: it starts writing only once ``release``
    is set, then fails with ``error`` if one is given. ``waiting`` is set when a later save of
    the same path has written its file and waits for the earlier one to end."""

    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    waiting: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


@pytest.fixture
def first_save_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldSave]:
    held, calls = HeldSave(), [0]
    real_write, real_wait = save.write_checkpoint, save_async._publish_after_earlier

    def write(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            assert held.release.wait(30), "the test never released the first save"
            if held.error is not None:
                raise held.error
        real_write(*args, **kwargs)

    def publish_after_earlier(handle: save_async.SaveHandle) -> None:
        if handle._earlier is not None:
            held.waiting.set()
        real_wait(handle)

    monkeypatch.setattr(save_async, "write_checkpoint", write)
    monkeypatch.setattr(save_async, "_publish_after_earlier", publish_after_earlier)
    yield held
    held.release.set()


def wait_until(condition: Callable[[], bool], event: threading.Event) -> None:
    """Wait until ``condition()`` holds, waking when ``event`` is set (or to look again)."""
    while not condition():
        event.wait(0.01)


def test_saves_of_one_path_publish_in_call_order(tmp_path: Path, first_save_held: HeldSave) -> None:
    """The oldest of three saves of one path is held back while the newer two are written: they
    wait for it, and the path ends with the newest state (the third save names the file through
    a symbolic link: the same file)."""
    release, waiting = first_save_held.release, first_save_held.waiting
    path = tmp_path / "ckpt.safetensors"
    link = tmp_path / "latest.safetensors"
    link.symlink_to(path.name)
    states = [{"w": random_tensor(1000 * (3 - i)), "version": i} for i in range(3)]
    handles = [ckptstream.save_async(states[0], path, max_in_flight=3),
               ckptstream.save_async(states[1], path, max_in_flight=3),
               ckptstream.save_async(states[2], link, max_in_flight=3)]
    # the second save is written and waits for the first (without ordering it would publish now)
    wait_until(lambda: waiting.is_set() or handles[1].done(), waiting)
    wait_until(lambda: handles[2].staged(), waiting)
    assert not path.exists()
    assert not any(h.done() for h in handles)
    release.set()
    assert [h.result() for h in handles] == [str(path)] * 3
    assert differences(ckptstream.load(path), states[2]) == []
    assert all(h._earlier is None for h in handles)
    assert [p.name for p in tmp_path.iterdir() if ".ckptstream-tmp-" in p.name] == []


def test_a_newer_save_publishes_after_an_older_one_fails(tmp_path: Path, first_save_held: HeldSave) -> None:
    release, waiting = first_save_held.release, first_save_held.waiting
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"old": torch.arange(3)}, path)
    first_save_held.error = OSError(errno.EIO, "Input/output error (injected)")
    older = ckptstream.save_async({"w": random_tensor(5000)}, path, max_in_flight=2)
    newer_state = {"w": random_tensor(700), "version": 2}
    newer = ckptstream.save_async(newer_state, path, max_in_flight=2)
    wait_until(lambda: waiting.is_set() or newer.done(), waiting)
    assert not newer.done()
    release.set()
    assert newer.result() == str(path)
    with pytest.raises(OSError, match="injected"):
        older.result()
    assert differences(ckptstream.load(path), newer_state) == []


def test_a_big_save_then_a_small_one_leave_the_small_state(tmp_path: Path) -> None:
    """Two saves in flight to one path, the older the larger (it finishes writing last): the
    newer state is the one left."""
    path = tmp_path / "ckpt.safetensors"
    big, small = {"w": random_tensor(1 << 21), "version": 1}, {"w": random_tensor(16), "version": 2}
    first = ckptstream.save_async(big, path, max_in_flight=2, settings=Settings(**SLOW))
    second = ckptstream.save_async(small, path, max_in_flight=2, settings=Settings(**SLOW))
    assert first.result() == second.result() == str(path)
    assert differences(ckptstream.load(path), small) == []


def test_saves_of_other_paths_do_not_wait_for_each_other(tmp_path: Path, first_save_held: HeldSave) -> None:
    release = first_save_held.release
    held = ckptstream.save_async({"w": random_tensor(100)}, tmp_path / "a.safetensors", max_in_flight=2)
    other = ckptstream.save_async({"w": random_tensor(100)}, tmp_path / "b.safetensors", max_in_flight=2)
    assert other.result() == str(tmp_path / "b.safetensors")  # while the first is still held
    assert not held.done()
    release.set()
    held.result()


# --- the end of the process ------------------------------------------------------------------


def test_exit_waits_for_the_save_in_flight_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    proc = run_child("child_exit.py", "in-flight", str(path))
    assert "waiting for the background save of" in proc.stderr
    assert f"{path} is saved" in proc.stderr
    assert torch.equal(ckptstream.load(path)["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("case", ["fails-in-flight", "failed-uncollected"])
def test_exit_says_loudly_that_a_failed_save_was_not_published(case: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    proc = run_child("child_exit.py", case, str(path))
    assert f"the background save of {path} FAILED and was NOT published: OSError" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_at_exit_abandons_the_save_says_so_and_exits_as_interrupted(tmp_path: Path) -> None:
    """The exit waits for a save that cannot end by itself; a real Ctrl-C, sent once the child
    says it waits, abandons it and ends the process as an interrupted Python ends (killed by
    SIGINT: status 130 in a shell), after the program's own atexit hooks, never with status 0."""
    path = tmp_path / "ckpt.safetensors"
    child = start_child("child_async_signals.py", "exit-wait", str(path))
    assert child.stderr is not None
    line = child.stderr.readline()
    said = f"--- stderr\n{line}"
    assert "waiting for the background save of" in line, said
    child.send_signal(signal.SIGINT)
    out, rest = child.communicate(timeout=60)
    said = f"--- stdout\n{out}\n--- stderr\n{line}{rest}"
    assert f"abandoned the background save of {path}: it was NOT published" in rest, said
    assert child.returncode == -signal.SIGINT, said
    assert "the program's own atexit hook ran" in out, said
    assert "Traceback" not in rest, said
    assert not path.exists(), said


def test_ctrl_c_in_result_leaves_the_save_running(tmp_path: Path) -> None:
    """result() interrupted by a real Ctrl-C raises KeyboardInterrupt; the save goes on, and a
    later result() returns its path once it is durable."""
    path = tmp_path / "ckpt.safetensors"
    child = start_child("child_async_signals.py", "result", str(path))
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "waiting in result()", line
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    said = f"--- stdout\n{line}{out}\n--- stderr\n{err}"
    assert child.returncode == 0, said
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"interrupted": True, "at_interrupt": {"done": False, "published": False}, "then": str(path)}, said
    assert ckptstream.load(path)["step"] == 5
    assert "waiting for the background save" not in err  # it had ended before the exit


def test_a_forked_child_does_not_wait_for_its_parents_saves(tmp_path: Path) -> None:
    """A DataLoader worker forked while a save is in flight (held back until the worker has
    exited) ends at once, with its own save done and without a word about its parent's."""
    path = tmp_path / "ckpt.safetensors"
    proc = run_child("child_async_signals.py", "fork", str(path))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"status": 0, "parent_save_done_when_child_exited": False}, proc.stdout + proc.stderr
    assert torch.equal(ckptstream.load(tmp_path / "ckpt.safetensors.child")["x"], torch.ones(3))
    assert (tmp_path / "ckpt.safetensors.child-stderr").read_text() == ""
    assert ckptstream.load(path)["step"] == 5


# --- on the GPU ----------------------------------------------------------------------------------


def _spin_then(fill: Callable[[], object]) -> None:
    """Queue a long kernel, then ``fill``: work still pending on the stream when the call comes."""
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time
    fill()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_copies_follow_earlier_work_and_precede_later_work(mode: str, tmp_path: Path) -> None:
    w = torch.zeros(1 << 22, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # w's zeros first
    with torch.cuda.stream(side):  # the training's own stream, not the default one
        _spin_then(lambda: w.fill_(1.0))
        handle = ckptstream.save_async({"w": w}, tmp_path / "ckpt.safetensors", mode=mode)
        if mode != "device":  # "host": a change outside an optimizer step is ordered by wait_staged()
            handle.wait_staged()
        w.fill_(2.0)  # a hand-written change
    handle.result()
    assert torch.equal(ckptstream.load(handle.path)["w"], torch.ones(1 << 22))


@pytest.mark.gpu
def test_gpu_device_mode_holds_a_snapshot_only_while_saving(tmp_path: Path, gate: threading.Event) -> None:
    w = random_tensor(1 << 24, device="cuda")  # 64 MiB
    expected = w.cpu().clone()
    gc.collect()  # an earlier test's GPU tensors held in a cycle would be freed in the middle
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = ckptstream.save_async({"w": w}, tmp_path / "ckpt.safetensors")
    assert torch.cuda.memory_allocated() - before == w.numel() * 4  # the snapshot
    w.zero_()
    gate.set()
    handle.result()
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(ckptstream.load(handle.path)["w"], expected)


@pytest.mark.gpu
def test_gpu_snapshot_of_a_save_that_ran_out_of_space_is_freed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The error of a full disk says how much room the checkpoint needs, and the error kept for
    result() holds no GPU snapshot (not even until the next garbage collection)."""
    state = {"w": random_tensor((1024, 1024), device="cuda"), "b": random_tensor(4096, torch.bfloat16, "cuda")}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fail_writes(monkeypatch)
    gc.disable()
    try:
        handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="device", settings=Settings(**SLOW))
        assert handle.mode == "device"
        while not handle.done():
            time.sleep(0.01)
        assert torch.cuda.memory_allocated() == before
    finally:
        gc.enable()
    with pytest.raises(OSError, match=r"No space left on device .* needs \d+ bytes") as e:
        handle.result()
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
def test_gpu_device_mode_without_the_memory_falls_back(tmp_path: Path) -> None:
    w = random_tensor(1 << 28, device="cuda")  # 1 GiB
    expected = w.cpu().clone()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    blocker = torch.empty(free - (700 << 20), dtype=torch.uint8, device="cuda")  # about 700 MiB left
    try:
        with pytest.warns(ckptstream.SnapshotFallbackWarning, match=r"1\.00 GiB on cuda:0"):
            handle = ckptstream.save_async({"w": w}, tmp_path / "ckpt.safetensors")
        assert handle.mode == "lazy"
        assert handle.staged()
        w.zero_()
        handle.result()
    finally:
        del blocker
        torch.cuda.empty_cache()  # the allocator would keep the GPU's memory from later tests' processes
    assert torch.equal(ckptstream.load(handle.path)["w"], expected)


@pytest.mark.gpu
def test_gpu_host_mode_copies_into_pinned_memory(tmp_path: Path) -> None:
    state = {"w": random_tensor((1024, 1024), torch.bfloat16, "cuda"), "step": torch.tensor(3.0)}
    expected = detached(state)
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
    handle.wait_staged()  # orders the zero_ below after the copies into pinned memory
    state["w"].zero_()
    state["step"].add_(1)
    handle.result()
    assert differences(ckptstream.load(handle.path), expected) == []
    assert os.path.getsize(handle.path) > 2 << 20


@pytest.mark.parametrize("fails", [False, True], ids=["durable", "failed"])
@pytest.mark.parametrize("mode", MODES)
def test_the_copy_is_freed_once_the_save_ends(mode: str, fails: bool, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A device snapshot is GPU memory the training wants back: no reference outlives the save
    (not even until the next garbage collection)."""
    kept: list[weakref.ref[torch.Tensor]] = []
    real = capture.capture

    def watched(tensors: list[torch.Tensor], mode: str, **kwargs: Any) -> capture.Captured:
        captured = real(tensors, mode, **kwargs)
        kept.extend(weakref.ref(t) for t in captured.tensors if all(t is not s for s in tensors))
        return captured

    monkeypatch.setattr(save_async, "capture", watched)
    if fails:
        fail_writes(monkeypatch)
    state = training_state(1 << 16)
    gc.disable()
    try:
        handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode=mode, settings=Settings(**SLOW))
        while not handle.done():  # the handle lives on, its error not asked for yet
            time.sleep(0.01)
        assert kept
        assert [r() for r in kept if r() is not None] == []
    finally:
        gc.enable()
    if fails:
        with pytest.raises(OSError, match="No space left"):
            handle.result()
    else:
        handle.result()



# --- "host": the snapshot memory is kept for the next save of the same size -------------------


@dataclasses.dataclass
class Blocks:
    """The blocks of snapshot memory made and freed, as (bytes, pinned)."""

    made: list[tuple[int, bool]] = dataclasses.field(default_factory=list)
    freed: list[tuple[int, bool]] = dataclasses.field(default_factory=list)


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Blocks]:
    """Counts the real blocks of snapshot memory; none is kept before or after the test."""
    seen = Blocks()

    class Counted(snapshot.Block):
        def __init__(self, size: int, pinned: bool) -> None:
            super().__init__(size, pinned)
            seen.made.append((size, pinned))

        def free(self) -> None:
            seen.freed.append((self.size, self.pinned))
            super().free()

    ckptstream.release_host_snapshot()
    monkeypatch.setattr(snapshot, "Block", Counted)
    yield seen
    ckptstream.release_host_snapshot()


def snapshot_size(state: Any) -> int:
    return snapshot.layout(save.plan_checkpoint(state, None, False).tensors)[1]


def assert_file_of(path: str | Path, state: Any, tmp_path: Path) -> None:
    ckptstream.save(state, tmp_path / "expected.safetensors")
    assert Path(path).read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_host_mode_keeps_its_snapshot_memory_for_the_next_save_of_the_same_size(tmp_path: Path,
                                                                                blocks: Blocks) -> None:
    first, second = training_state(1 << 16), training_state(1 << 16)  # the same shapes, other values
    size = snapshot_size(first)
    assert size >= (1 << 16) * 4
    handle = ckptstream.save_async(first, tmp_path / "1.safetensors", mode="host")
    assert ckptstream.host_snapshot_bytes() == size  # lent to the save in flight
    handle.result()
    assert ckptstream.host_snapshot_bytes() == size  # kept
    ckptstream.save_async(second, tmp_path / "2.safetensors", mode="host").result()
    assert blocks.made == [(size, False)]  # the second save took the first one's memory
    assert_file_of(tmp_path / "1.safetensors", first, tmp_path)
    assert_file_of(tmp_path / "2.safetensors", second, tmp_path)
    # another size: the kept memory is freed before the new block is made, and the new one kept
    other = training_state(1 << 17)
    ckptstream.save_async(other, tmp_path / "3.safetensors", mode="host").result()
    assert blocks.made == [(size, False), (snapshot_size(other), False)]
    assert blocks.freed == [(size, False)]
    assert ckptstream.host_snapshot_bytes() == snapshot_size(other)
    assert_file_of(tmp_path / "3.safetensors", other, tmp_path)
    assert ckptstream.release_host_snapshot() == snapshot_size(other)
    assert ckptstream.host_snapshot_bytes() == 0
    assert ckptstream.release_host_snapshot() == 0


def test_a_host_save_whose_thread_cannot_start_gives_its_snapshot_memory_back(
        tmp_path: Path, blocks: Blocks, monkeypatch: pytest.MonkeyPatch) -> None:
    state = training_state(1 << 16)
    real = control.start

    def refuse(thread: threading.Thread, what: str) -> None:
        raise ckptstream.ThreadStartError(f"ckptstream could not start {what}: can't start new thread")

    monkeypatch.setattr(control, "start", refuse)
    with pytest.raises(ckptstream.ThreadStartError):
        ckptstream.save_async(state, tmp_path / "a.safetensors", mode="host")
    monkeypatch.setattr(control, "start", real)
    assert save_async.in_flight() == []
    assert not (tmp_path / "a.safetensors").exists()
    ckptstream.save_async(state, tmp_path / "a.safetensors", mode="host").result()
    assert blocks.made == [(snapshot_size(state), False)]  # the failed save's block was given back, then reused
    assert_file_of(tmp_path / "a.safetensors", state, tmp_path)


def test_warm_host_snapshot_pays_before_the_first_save(tmp_path: Path, blocks: Blocks) -> None:
    state = training_state(1 << 16)
    assert ckptstream.warm_host_snapshot(state) == snapshot_size(state)
    assert blocks.made == [(snapshot_size(state), False)]
    ckptstream.save_async(state, tmp_path / "a.safetensors", mode="host").result()
    assert blocks.made == [(snapshot_size(state), False)]
    assert_file_of(tmp_path / "a.safetensors", state, tmp_path)
    for other_mode in ["device", "lazy"]:  # other modes neither take nor free it
        ckptstream.save_async(state, tmp_path / "b.safetensors", mode=other_mode).result()
    assert (blocks.made, blocks.freed) == ([(snapshot_size(state), False)], [])
    assert ckptstream.warm_host_snapshot({"step": 3, "empty": torch.empty(0)}) == 0  # nothing to hold
    with pytest.raises(ckptstream.UnsupportedTypeError, match="object"):
        ckptstream.warm_host_snapshot({"w": object()})
    assert ckptstream.host_snapshot_bytes() == snapshot_size(state)


def test_host_saves_in_flight_at_once_never_share_snapshot_memory(tmp_path: Path, blocks: Blocks,
                                                                   gate: threading.Event) -> None:
    first, second = training_state(1 << 16), training_state(1 << 16)
    expected = [detached(first), detached(second)]
    ckptstream.warm_host_snapshot(first)  # kept: the first save takes it, the second needs its own
    handles = [ckptstream.save_async(s, tmp_path / f"{i}.safetensors", mode="host", max_in_flight=2)
               for i, s in enumerate([first, second])]
    mutate(first)
    mutate(second)
    gate.set()  # both were captured before either writes
    for i, handle in enumerate(handles):
        handle.result()
        assert differences(ckptstream.load(handle.path), expected[i]) == [], i
    size = snapshot_size(first)
    assert blocks.made == [(size, False), (size, False)]
    assert blocks.freed == [(size, False)]  # one kept once both ended
    assert ckptstream.host_snapshot_bytes() == size


@pytest.mark.gpu
def test_gpu_a_second_host_save_of_the_same_layout_allocates_no_pinned_memory(tmp_path: Path, blocks: Blocks,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[torch.Tensor]] = []
    real = capture.capture

    def watched(tensors: list[torch.Tensor], mode: str, **kwargs: Any) -> capture.Captured:
        captured = real(tensors, mode, **kwargs)
        seen.append([t for t in captured.tensors if t.numel()])
        return captured

    monkeypatch.setattr(save_async, "capture", watched)

    def state() -> dict[str, Any]:
        return {"w": random_tensor((4096, 4096), device="cuda"), "b": random_tensor(4097, torch.bfloat16, "cuda"),
                "step": torch.tensor(3.0), "m": [random_tensor(1 << 20, device="cuda") for _ in range(3)]}

    first, second = state(), state()
    expected = [detached(first), detached(second)]
    torch_allocs = torch.cuda.host_memory_stats().get("num_host_alloc")
    handle = ckptstream.save_async(first, tmp_path / "1.safetensors", mode="host")
    handle.result()
    pointers = [t.data_ptr() for t in seen[0]]
    handle = ckptstream.save_async(second, tmp_path / "2.safetensors", mode="host")
    handle.wait_staged()
    for t in [second["w"], second["b"], *second["m"]]:
        t.add_(1.0)  # ordered after the copies into the reused memory
    handle.result()
    assert blocks.made == [(snapshot_size(first), True)]  # one block registered with CUDA, for both saves
    assert all(t.is_pinned() for t in seen[1])
    assert [t.data_ptr() for t in seen[1]] == pointers
    assert torch.cuda.host_memory_stats().get("num_host_alloc") == torch_allocs  # nor any of torch's pinned memory
    for i in range(2):
        assert differences(ckptstream.load(tmp_path / f"{i + 1}.safetensors"), expected[i]) == [], i
    assert ckptstream.host_snapshot_bytes() == snapshot_size(first)
