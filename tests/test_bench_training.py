"""The stall benchmark's one figure: training time lost per checkpoint, the wall time of the same
N steps with one checkpoint minus without, the wait for durability at the end included, and its
parts (blocked, slowed steps, wait at end). The accounting is checked exactly on a simulated
clock, the choice of N and the notes on a real loop on the CPU."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli
from ckptstream.bench import checkpointers, options, training
from tests.helpers import needs_ctrl_c
from tests.test_bench import run_until

TINY = 1 / 1024  # GiB: about 1 MiB of state
STEP, SLOWER, GATE, CALL, WAIT = 0.010, 0.002, 0.003, 0.005, 0.100  # seconds on the simulated clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeLoop:
    """A training step takes STEP on the clock, SLOWER more while a checkpoint is in flight, and
    GATE more when the step has to wait for the checkpoint before its update."""

    device = torch.device("cpu")

    def __init__(self, clock: Clock) -> None:
        self.clock, self.gate_s, self.in_flight = clock, 0.0, False

    def step(self, gate: Callable[[], None] | None = None) -> float:
        began = self.clock.now
        self.gate_s = 0.0
        if gate is not None:
            gate()
            self.gate_s = GATE
            self.clock.now += GATE
        self.clock.now += STEP + (SLOWER if self.in_flight else 0.0)
        return self.clock.now - began

    def state(self) -> dict[str, torch.Tensor]:
        return {}


def fake_checkpointer(clock: Clock, loop: FakeLoop, written_after: int | None) -> checkpointers.Start:
    """A checkpoint whose call takes CALL, that gates every step while in flight, and that is
    durable after ``written_after`` steps (None: only when ``finish`` has waited WAIT for it)."""

    def begin(state: dict[str, torch.Tensor], path: str) -> checkpointers.Job:
        clock.now += CALL
        loop.in_flight, steps = True, [0]
        durable: list[float | None] = [None]

        def gate() -> None:
            steps[0] += 1

        def done() -> bool:
            if loop.in_flight and written_after is not None and steps[0] >= written_after:
                loop.in_flight, durable[0] = False, clock.now
            return not loop.in_flight

        def finish() -> None:
            if loop.in_flight:
                clock.now += WAIT
                loop.in_flight, durable[0] = False, clock.now

        return checkpointers.Job(done, lambda: durable[0], gate, finish)

    return begin


def simulate(monkeypatch: pytest.MonkeyPatch, steps: int, written_after: int | None) -> dict[str, Any]:
    clock = Clock()
    monkeypatch.setattr(training, "_clock", clock)
    loop = FakeLoop(clock)
    without, times = training._plain(loop, steps)  # type: ignore[arg-type]
    assert without == pytest.approx(steps * STEP)
    assert times == pytest.approx([STEP] * steps)
    begin = fake_checkpointer(clock, loop, written_after)
    return training._checkpoint(begin, loop, "unused", steps, without, STEP)  # type: ignore[arg-type]


def test_lost_time_of_a_write_that_ends_inside_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    row = simulate(monkeypatch, steps=10, written_after=4)
    # the call, then 4 gated steps in flight, each slower, then 6 plain steps; nothing to wait for
    assert row["blocked_s"] == pytest.approx(CALL + 4 * GATE)
    assert row["slowed_s"] == pytest.approx(4 * SLOWER)
    assert row["waited_s"] == pytest.approx(0.0)
    assert row["lost_s"] == pytest.approx(CALL + 4 * (GATE + SLOWER))
    assert row["ended_inside"] is True
    assert row["durable_s"] == pytest.approx(CALL + 4 * (STEP + SLOWER + GATE))
    assert row["stall_s"] == pytest.approx(CALL + GATE + SLOWER)
    assert row["steps_in_flight"] == 3  # after the first, which holds the stall
    assert row["slowdown"] == pytest.approx((STEP + SLOWER + GATE) / STEP - 1)


def test_lost_time_includes_the_wait_for_a_write_that_outlasts_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    row = simulate(monkeypatch, steps=10, written_after=None)
    assert row["waited_s"] == pytest.approx(WAIT)
    assert row["blocked_s"] == pytest.approx(CALL + 10 * GATE)
    assert row["slowed_s"] == pytest.approx(10 * SLOWER)
    assert row["lost_s"] == pytest.approx(CALL + 10 * (GATE + SLOWER) + WAIT)
    assert row["ended_inside"] is False
    assert row["durable_s"] == pytest.approx(CALL + 10 * (STEP + SLOWER + GATE) + WAIT)


@pytest.fixture
def outlasting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system "slow" whose write ends only when the loop waits for it after its last step."""
    real = checkpointers.session

    @contextlib.contextmanager
    def session(system: str, device: torch.device) -> Iterator[checkpointers.Start]:
        if system != "slow":
            with real(system, device) as begin:
                yield begin
            return
        stop = [False]

        def slow(state: dict[str, torch.Tensor], path: str) -> checkpointers.Job:
            open(path, "wb").close()
            stop[0] = False
            ended = [0.0]

            def finish() -> None:
                stop[0] = True
                ended[0] = training._clock()

            return checkpointers.Job(lambda: stop[0], lambda: ended[0], finish=finish)

        yield slow

    monkeypatch.setattr(training, "session", session)


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")  # DCP, no group
def test_one_n_for_every_system_and_a_note_for_a_write_that_outlasted_it(tmp_path: Path, outlasting: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = iter([11, 29, 31])  # what each process would choose by itself
    monkeypatch.setattr(training, "auto_steps", lambda state_bytes, step_s: next(chosen))
    result = training.run(TINY, device="cpu", systems=["slow", "device", "dcp.async_save+pinned"],
                          directory=str(tmp_path), checkpoints=1, isolate=False)
    assert result["steps"] == 11
    for name, row in result["systems"].items():
        if name == "dcp.async_save+pinned" and "error" in row:
            assert "needs torch 2.9 or later" in row["error"]
            continue
        assert "error" not in row, (name, row)
        assert row["steps"] == 11
        assert row["lost_s"] == pytest.approx(row["blocked_s"] + row["slowed_s"] + row["waited_s"])
    slow = result["systems"]["slow"]
    assert slow["ended_inside"] is False
    assert slow["steps_in_flight"] == 10
    (note,) = [n for n in result["notes"] if n.startswith("slow:")]
    assert "outlasted the 11 steps" in note
    assert f"--training-steps {math.ceil(slow['durable_s'] / slow['step_s']) + 1} or more" in note
    table = training.render(result)
    assert "the same 11 steps with one checkpoint minus without" in table
    assert f"note: {note}" in table
    assert list(tmp_path.iterdir()) == []


def test_explicit_steps_and_the_automatic_choice(tmp_path: Path) -> None:
    result = training.run(TINY, device="cpu", systems=["device"], directory=str(tmp_path), checkpoints=1,
                          steps=13, isolate=False)
    assert result["steps"] == result["systems"]["device"]["steps"] == 13
    assert training.auto_steps(10**9, 0.05) == 50  # 1 GB at 0.4 GB/s is 2.5 s: 50 steps of 50 ms
    assert training.auto_steps(10**6, 1.0) == training.MIN_STEPS


def test_an_interrupted_training_run_reports_the_systems_it_measured(tmp_path: Path) -> None:
    needs_ctrl_c()  # the run's SIGINT reaches a child that inherits how SIGINT is handled here
    out = tmp_path / "stall.json"
    rc, stdout, stderr = run_until([sys.executable, "-m", "ckptstream.cli", "bench", "--training", "--device", "cpu",
                                    "--size-gib", str(TINY), "--repeat", "1", "--dir", str(tmp_path),
                                    "--training-systems", "sync", "device", "--json", str(out)],
                                   "stall benchmark: device")
    assert rc == 130, stderr
    result = json.loads(out.read_text())["training"]
    assert list(result["systems"]) == ["sync"]
    assert result["systems"]["sync"]["lost_s"] == pytest.approx(
        sum(result["systems"]["sync"][k] for k in ("blocked_s", "slowed_s", "waited_s")))
    assert result["notes"][-1].startswith("interrupted")
    assert "note: interrupted" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stall.json"]


def test_repeat_is_the_number_of_checkpoints_per_system(tmp_path: Path) -> None:
    def resolved(*args: str) -> options.Options:
        return options.resolve_options(cli.build_parser().parse_args(["bench", "--dir", str(tmp_path), *args]))

    assert resolved("--training").repeat == 2
    assert resolved("--training", "--repeat", "1", "--size-gib", "8").repeat == 1
    assert resolved("--training", "--training-steps", "240").training_steps == 240
    assert resolved("--size-gib", "8").repeat == 1  # loads: one run per figure for a large state


def test_dcp_pinned_uses_torchtitans_staging_options() -> None:
    staging = pytest.importorskip("torch.distributed.checkpoint.staging", reason="DCP's DefaultStager: torch 2.9+")
    if not hasattr(staging, "DefaultStager"):
        pytest.skip(f"torch {torch.__version__} has no DefaultStager (2.9 and later)")
    stager = checkpointers._pinned_stager()
    try:
        cuda = torch.cuda.is_available()  # pinned memory and non-blocking copies need CUDA
        assert stager._config == staging.StagingOptions(cuda, True, True, cuda)
    finally:
        stager.close()


def test_the_parts_add_up_over_several_checkpoints() -> None:
    def run(lost: float, blocked: float, waited: float, inside: bool) -> dict[str, Any]:
        return {"lost_s": lost, "blocked_s": blocked, "slowed_s": lost - blocked - waited, "waited_s": waited,
                "ended_inside": inside, "durable_s": None}

    row = training.medians([run(1.0, 0.9, 0.0, True), run(2.0, 0.1, 0.0, True), run(3.0, 0.5, 0.25, False)])
    assert (row["lost_s"], row["blocked_s"], row["waited_s"]) == (2.0, 0.5, 0.0)
    assert row["slowed_s"] == pytest.approx(1.5)  # the median of the slowed steps alone would be 1.9
    assert row["ended_inside"] is False  # one write outlasted its loop
    assert row["durable_s"] is None


@pytest.mark.parametrize("mode", checkpointers.OURS)
def test_the_loop_calls_wait_staged_just_before_the_update(mode: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What the target for "host" mode assumes: while a save_async is in flight, the loop calls
    ``handle.wait_staged()`` after the backward pass and before ``optimizer.step()``."""
    loop = training.Loop(int(TINY * training.GiB), torch.device("cpu"))
    loop.step()  # the optimizer's moments exist from the first step on
    log: list[str] = []
    real_wait, real_step = ckptstream.SaveHandle.wait_staged, loop.opt.step

    def wait_staged(self: ckptstream.SaveHandle, timeout: float | None = None) -> None:
        log.append("wait_staged" if all(p.grad is not None for p in loop.params) else "wait_staged before backward")
        real_wait(self, timeout)

    def step(*args: Any, **kwargs: Any) -> Any:
        log.append("step")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(ckptstream.SaveHandle, "wait_staged", wait_staged)
    monkeypatch.setattr(loop.opt, "step", step)
    job = checkpointers.start(mode, loop.state(), str(tmp_path / "ckpt.safetensors"))
    loop.step(job.gate)
    job.finish()
    assert log == ["wait_staged", "step"]
    assert "calls its gate just before optimizer.step() (save_async: handle.wait_staged()" in training.render(
        {"systems": {}, "steps": 3})


def test_the_manager_row_writes_a_complete_step(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1000, 37, generator=gen), "b": torch.randn(4099, generator=gen)}
    path = str(tmp_path / "ckpt-0")
    with checkpointers.session("manager.device", torch.device("cpu")) as begin:
        job = begin(state, path)
        if job.gate is not None:
            job.gate()
        expected = {k: v.clone() for k, v in state.items()}
        for v in state.values():
            v.add_(1.0)  # the update after the gate: not in the checkpoint
        job.finish()
    assert job.durable_at() is not None
    with ckptstream.CheckpointManager(path) as manager:
        assert manager.steps() == [1]
        loaded = manager.load(1)
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert torch.equal(loaded[k], v)
