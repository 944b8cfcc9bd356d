"""The guard that orders training's changes of saved tensors after a background save's read
(``ckptstream._checkpoint.guard``), on the CPU: where its hooks order (before an optimizer's update, after
its closure; before a training-mode forward of a module holding a saved buffer), when they arm
and disarm, and that a forked child owns none of its parent's holds. The CUDA side (a "host"
save's copies on a side stream) is in test_host_stream_gpu.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import ckptstream
from ckptstream._checkpoint import guard as _guard
from ckptstream._checkpoint.guard import Guard, storage_keys


class Watch:
    """A hold on ``tensors`` that, when ordered, records their values at that moment: what a
    change queued next would find (a real save's read would come first)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors, self.storages = tensors, storage_keys(tensors)
        self.seen: list[list[torch.Tensor]] = []
        self.finished = False

    def order(self) -> None:
        self.seen.append([t.detach().clone() for t in self.tensors])

    def done(self) -> bool:
        return self.finished


def hook_counts() -> tuple[int, int]:
    return len(nn_module._global_forward_pre_hooks), len(optim_module._global_optimizer_pre_hooks)


@pytest.fixture
def guard() -> Iterator[Guard]:
    before = hook_counts()
    g = Guard()
    yield g
    g.forget()
    g.close()
    assert hook_counts() == before


def trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(3, model[0].in_features)).square().sum().backward()  # type: ignore[index]
    return opt


@pytest.mark.parametrize("how", ["no-closure", "closure-by-position", "closure-by-keyword"])
def test_the_update_is_ordered_after_the_hold_and_the_closure_before_it(guard: Guard, how: str) -> None:
    linear = torch.nn.Linear(50, 40)
    model = torch.nn.Sequential(linear)
    opt = trained(model)
    before = [p.detach().clone() for p in model.parameters()]
    watch = Watch(list(model.parameters()))
    guard.arm(watch)
    ran: list[int] = []

    def closure() -> float:
        ran.append(len(watch.seen))  # how often the hold was ordered when the forward pass ran
        opt.zero_grad()
        loss = model(torch.randn(3, 50)).square().sum()
        loss.backward()
        return float(loss.detach())

    if how == "no-closure":
        opt.step()
    elif how == "closure-by-position":
        opt.step(closure)
    else:
        opt.step(closure=closure)
    assert len(watch.seen) == 1
    for seen, old in zip(watch.seen[0], before, strict=True):
        assert torch.equal(seen, old)  # ordered before the update changed them
    if how != "no-closure":
        assert ran == [0]  # the forward and backward pass ran before the ordering: they overlap the save
    assert not torch.equal(linear.weight, before[0])


def test_a_training_forward_of_a_module_holding_a_saved_buffer_is_ordered(guard: Guard) -> None:
    bn, other = torch.nn.BatchNorm1d(64), torch.nn.BatchNorm1d(64)
    bn(torch.randn(8, 64))
    assert bn.running_mean is not None
    saved = bn.running_mean.clone()
    watch = Watch([bn.running_mean])
    guard.arm(watch)
    bn.eval()
    bn(torch.randn(8, 64))  # no update in eval mode
    other(torch.randn(8, 64))  # its buffers are not saved
    torch.nn.Linear(4, 4).train()(torch.randn(2, 4))  # no buffers at all
    assert watch.seen == []
    bn.train()
    bn(torch.randn(8, 64))
    assert len(watch.seen) == 1
    assert torch.equal(watch.seen[0][0], saved)
    assert not torch.equal(bn.running_mean, saved)


def test_only_the_holds_on_a_modules_buffers_are_ordered_before_its_forward(guard: Guard) -> None:
    bn = torch.nn.BatchNorm1d(16)
    assert bn.running_var is not None
    mine, elsewhere = Watch([bn.running_var]), Watch([torch.randn(16)])
    guard.arm(mine)
    guard.arm(elsewhere)
    bn(torch.randn(4, 16))
    assert (len(mine.seen), len(elsewhere.seen)) == (1, 0)


def test_the_forward_hook_goes_once_no_hold_is_pending_and_the_step_hook_at_close() -> None:
    before = hook_counts()
    g = Guard()
    model = torch.nn.Sequential(torch.nn.Linear(6, 6))
    opt = trained(model)
    first, second = Watch(list(model.parameters())), Watch(list(model.parameters()))
    g.arm(first)
    g.arm(second)
    assert hook_counts() == (before[0] + 1, before[1] + 1)
    assert g.armed()
    first.finished = True
    model(torch.randn(1, 6))
    assert hook_counts()[0] == before[0] + 1  # one hold still pending
    second.finished = True
    model(torch.randn(1, 6))  # the first module call that finds none removes the forward hook
    assert hook_counts() == (before[0], before[1] + 1)
    assert not g.armed()
    opt.step()  # nothing pending: nothing ordered
    assert (first.seen, second.seen) == ([], [])
    third = Watch(list(model.parameters()))
    g.arm(third)  # armed again: the forward hook is back, the step hook not doubled
    assert hook_counts() == (before[0] + 1, before[1] + 1)
    g.close()
    assert len(third.seen) == 1
    assert hook_counts() == before


def test_order_drops_the_holds_that_are_done() -> None:
    g = Guard()
    a, b = Watch([torch.randn(3)]), Watch([torch.randn(3)])
    g.arm(a)
    g.arm(b)
    b.finished = True
    g.order()
    assert (len(a.seen), len(b.seen)) == (1, 0)
    a.finished = True
    assert g.pending() == []
    g.close()


def test_a_forked_child_owns_none_of_its_parents_holds() -> None:
    watch = Watch([torch.randn(3)])
    _guard.GUARD.arm(watch)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report how many holds it sees, and leave at once
            os.write(write, str(len(_guard.GUARD.pending())).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            seen = f.read()
        assert os.waitpid(pid, 0)[1] == 0
        assert seen == "0"
        assert _guard.GUARD.pending() == [watch]
    finally:
        watch.finished = True
        _guard.GUARD.order()


def test_a_host_save_of_cpu_tensors_arms_nothing(tmp_path: Path) -> None:
    """CPU tensors are copied by value at the call: nothing to order, staged at once."""
    before = hook_counts()
    w = torch.randn(1000)
    expected = w.clone()
    handle = ckptstream.save_async({"w": w}, tmp_path / "ckpt.safetensors", mode="host")
    assert handle.staged()
    assert hook_counts() == before
    assert _guard.GUARD.pending() == []
    w.add_(1.0)
    handle.result()
    assert torch.equal(ckptstream.load(handle.path)["w"], expected)
