"""save_async(mode="host") on a GPU: the device-to-host copies run on a side stream beside the
caller's work, and what changes the state next is ordered after them: an optimizer's update and
a training-mode forward that updates a saved buffer without any call (the process's guard), a
hand-written change after ``wait_staged()``. The states are large (1-2 GiB) and a long kernel is
queued before the call, so that the copies are still running when the change is queued. Every
assertion is on saved bytes or on the GPU's own order of events, never on wall time."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.modules import module as nn_module

import ckptstream
from ckptstream._checkpoint import capture as _capture
from ckptstream._checkpoint import guard as _guard
from tests.helpers import random_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_save_left_behind")]
ELEMENTS = 1 << 27  # 512 MiB of float32 per tensor
SPIN = 1_000_000_000  # cycles of torch.cuda._sleep: about half a second of GPU time


@pytest.fixture(autouse=True)
def _snapshot_memory_given_back() -> Iterator[None]:
    """Each test warms the snapshot memory of its state (``warm_host_snapshot``) before it queues
    the long kernel, so that its save's copies are all queued while that kernel still runs; the
    memory is freed after it (the states are large)."""
    yield
    ckptstream.release_host_snapshot()


def big_params(count: int = 4) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(random_tensor(ELEMENTS, device="cuda")) for _ in range(count)]
    for p in params:
        p.grad = random_tensor(ELEMENTS, device="cuda")
    return params


def cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in tensors.items()}


def assert_saved(path: str, expected: dict[str, torch.Tensor]) -> None:
    loaded = ckptstream.load(path)
    assert sorted(loaded) == sorted(expected)
    for key, want in expected.items():
        assert torch.equal(loaded[key], want), f"{key}: the file does not hold the values of the call"


def host_waits_in_this_thread(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The host waits on CUDA (event, stream or device synchronize) made from this thread, by name
    (each still waits for real)."""
    me, seen = threading.current_thread(), []
    for owner, name in [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                        (torch.cuda, "synchronize")]:
        real = getattr(owner, name)

        def spy(*args: Any, _real: Any = real, _what: str = f"{getattr(owner, '__name__', owner)}.{name}",
                **kwargs: Any) -> Any:
            if threading.current_thread() is me:
                seen.append(_what)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return seen


@pytest.mark.parametrize("closure", [False, True], ids=["step", "step-with-closure"])
def test_an_optimizer_step_right_after_the_call_runs_after_the_copies(tmp_path: Path, closure: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    params = big_params()
    opt = torch.optim.SGD(params, lr=1.0)
    state = {f"p{i}": p for i, p in enumerate(params)}
    expected = cpu_copies(state)
    ckptstream.warm_host_snapshot(state)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the copies and the update both queue behind it
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
    waits = host_waits_in_this_thread(monkeypatch)
    if closure:
        opt.step(lambda: params[0].sum())  # a closure reads the weights, as a forward pass does
    else:
        opt.step()  # no wait_staged(): the guard orders the update
    assert waits == []  # ordered on the GPU: the host went on at once
    monkeypatch.undo()
    handle.result()
    assert_saved(handle.path, expected)
    assert not torch.equal(params[0].detach().cpu(), expected["p0"])  # the update did run


def test_a_training_forward_that_updates_saved_statistics_runs_after_the_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bn = torch.nn.BatchNorm1d(ELEMENTS // 2, device="cuda")  # running statistics of 256 MiB each
    assert bn.running_mean is not None
    assert bn.running_var is not None
    bn.running_mean.copy_(random_tensor(ELEMENTS // 2, device="cuda"))
    bn.running_var.copy_(random_tensor(ELEMENTS // 2, device="cuda").abs())
    x = random_tensor((2, ELEMENTS // 2), device="cuda")
    state = {f"bn.{k}": v for k, v in bn.state_dict().items()}
    expected = cpu_copies(state)
    ckptstream.warm_host_snapshot(state)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
    waits = host_waits_in_this_thread(monkeypatch)
    bn(x)  # training mode: updates the running statistics in place
    assert waits == []
    monkeypatch.undo()
    handle.result()
    assert_saved(handle.path, expected)
    assert not torch.equal(bn.running_mean.cpu(), expected["bn.running_mean"])


def test_a_hand_written_change_after_wait_staged_runs_after_the_copies(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"w{i}": random_tensor(ELEMENTS, device="cuda") for i in range(2)}
    expected = cpu_copies(state)
    ckptstream.warm_host_snapshot(state)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
    waits = host_waits_in_this_thread(monkeypatch)
    handle.wait_staged()  # returns at once: the current stream now waits for the copies
    assert waits == []
    monkeypatch.undo()
    with torch.no_grad():
        for w in state.values():
            w.add_(1.0)  # no optimizer, no forward: the caller's job to order it
    handle.result()
    assert_saved(handle.path, expected)
    assert handle.staged()


def test_a_save_on_the_callers_own_stream_follows_its_work_and_precedes_its_update(tmp_path: Path) -> None:
    params = big_params()
    opt = torch.optim.SGD(params, lr=1.0)
    state = {f"p{i}": p for i, p in enumerate(params)}
    expected = {k: -v for k, v in cpu_copies(state).items()}
    ckptstream.warm_host_snapshot(state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the training's own stream, not the default one
        torch.cuda._sleep(SPIN)
        with torch.no_grad():
            for p in params:
                p.mul_(-1.0)  # work that produced the state, still pending at the call
        handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
        opt.step()
    handle.result()
    assert_saved(handle.path, expected)


def test_the_callers_stream_does_not_wait_for_the_copies(tmp_path: Path) -> None:
    """A kernel queued on the caller's stream after the call ends before the copies do (the GPU's
    own timestamps: ``elapsed_time`` from the kernel's event to the copies' is positive)."""
    state = {f"w{i}": random_tensor(ELEMENTS, device="cuda") for i in range(4)}  # 2 GiB: the copies take a while
    ckptstream.warm_host_snapshot(state)
    torch.cuda.synchronize()
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
    copies_end = torch.cuda.Event(enable_timing=True)
    copies_end.record(_capture._side_stream(state["w0"].device))  # queued after the copies
    torch.ones(16, device="cuda").add_(1.0)  # the next step's first kernel
    caller_next = torch.cuda.Event(enable_timing=True)
    caller_next.record()
    handle.result()
    torch.cuda.synchronize()
    assert caller_next.elapsed_time(copies_end) > 0, "the caller's stream waited behind the copies"


def test_a_freed_tensor_is_not_reused_under_the_copies(tmp_path: Path) -> None:
    w = random_tensor(ELEMENTS * 2, device="cuda")  # 1 GiB
    expected = {"w": w.cpu()}
    scratch = w * 1.0  # a temporary the caller saves, then drops
    ckptstream.warm_host_snapshot({"w": scratch})
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    handle = ckptstream.save_async({"w": scratch}, tmp_path / "ckpt.safetensors", mode="host")
    del scratch
    junk = torch.empty_like(w).fill_(7.0)  # the allocator's first pick is the memory just freed
    handle.result()
    assert_saved(handle.path, expected)
    del junk


def test_the_guard_lets_go_once_the_copies_are_done(tmp_path: Path) -> None:
    assert _guard.GUARD.pending() == []  # the saves of the tests before have ended
    _guard.GUARD.order()  # and no forward hook of theirs is left for a module call to remove
    before = len(nn_module._global_forward_pre_hooks)
    state = {"w": random_tensor(ELEMENTS, device="cuda")}
    handle = ckptstream.save_async(state, tmp_path / "ckpt.safetensors", mode="host")
    assert len(nn_module._global_forward_pre_hooks) == before + 1  # armed while the copies run
    handle.result()
    assert handle.staged()
    assert _guard.GUARD.pending() == []
    torch.nn.Linear(4, 4, device="cuda")(torch.randn(2, 4, device="cuda"))  # the next module call disarms it
    assert len(nn_module._global_forward_pre_hooks) == before

