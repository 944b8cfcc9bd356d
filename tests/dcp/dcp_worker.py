"""One rank of a DCP test job: ``python dcp_worker.py SCENARIO RANK WORLD WORKDIR STORE BACKEND``.

Each scenario runs on a real process group (gloo on the CPU, NCCL with gloo beside it for CUDA)
and raises on any mismatch, so the rank exits non-zero; the test reads the files it leaves in
WORKDIR.
"""

from __future__ import annotations

import datetime
import errno
import gc
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstream
import ckptstream.dcp
from ckptstream import Settings
from ckptstream._storage import fileio
from ckptstream.bench.measure import PeakRss
from tests.dcp.dcp_helpers import (
    EXTRA,
    SEED,
    global_tensors,
    has_hf_reader,
    plain_value,
    poisoned_like,
    rank_local,
    same_bits,
)

try:
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import (  # type: ignore[attr-defined]
        DTensor,
        Placement,
        Replicate,
        Shard,
        distribute_tensor,
    )
from torch.distributed.device_mesh import init_device_mesh

MODES = ("device", "lazy", "host")


class Ctx:
    def __init__(self, rank: int, world: int, workdir: Path, device: torch.device) -> None:
        self.rank, self.world, self.workdir, self.device = rank, world, workdir, device
        self.mesh = init_device_mesh(device.type, (world,))


def dstate(ctx: Ctx, full: dict[str, torch.Tensor], placements: dict[str, Any], *, rank_plain: torch.Tensor,
           extra: dict[str, Any]) -> dict[str, Any]:
    """The nested DCP state: DTensors of ``full`` with ``placements`` per key, a plain tensor
    (DCP treats it as replicated), a 0-d tensor and non-tensor values."""
    def d(key: str) -> Any:
        return distribute_tensor(full[key].to(ctx.device), ctx.mesh, [placements[key]])
    return {
        "model": {"W": d("model.W"), "V": d("model.V"), "H": d("model.H")},
        "ints": d("ints"),
        "tiny": d("tiny"),
        "plain": rank_plain.to(ctx.device),
        "scalar": torch.tensor(3.5, device=ctx.device),
        "extra": dict(extra),
    }


def flat(state: dict[str, Any]) -> dict[str, Any]:
    return {"model.W": state["model"]["W"], "model.V": state["model"]["V"], "model.H": state["model"]["H"],
            "ints": state["ints"], "tiny": state["tiny"]}


def target(ctx: Ctx, kind: str) -> dict[str, Any]:
    """A poisoned destination state sharded as ``kind`` ("shard1" or "replicate")."""
    full = {k: poisoned_like(v) for k, v in global_tensors().items()}
    placements: dict[str, Placement]
    if kind == "replicate":
        placements = dict.fromkeys(full, Replicate())
    else:
        placements = {k: Shard(1) for k in full}
        placements["model.V"] = Replicate()  # one dimension only
    return dstate(ctx, full, placements, rank_plain=poisoned_like(plain_value(0)),
                  extra={"step": 0, "lr": 0.0, "names": [], "note": ""})


def check_loaded(ctx: Ctx, state: dict[str, Any], what: str) -> None:
    want = global_tensors()
    for key, value in flat(state).items():
        got = value.full_tensor().cpu()
        assert same_bits(got, want[key]), f"{what}: {key} differs"
        assert value.to_local().device.type == ctx.device.type, f"{what}: {key} landed on {value.to_local().device}"
    assert state["extra"] == EXTRA, f"{what}: extra {state['extra']}"
    assert same_bits(state["scalar"].cpu(), torch.tensor(3.5)), what
    # DCP's rule for plain tensors: replicated, so every rank loads the one value saved
    plains = [torch.empty(4, 3) for _ in range(ctx.world)]
    dist.all_gather_object(plains, state["plain"].cpu())
    assert all(same_bits(p, plains[0]) for p in plains), f"{what}: ranks loaded different plain tensors"
    assert sum(same_bits(plains[0], plain_value(r)) for r in range(ctx.world)) == 1, f"{what}: plain is no rank's"


def save_sharded(ctx: Ctx, path: Path, **options: Any) -> dict[str, Any]:
    placements = dict.fromkeys(global_tensors(), Shard(0))
    state = dstate(ctx, global_tensors(), placements, rank_plain=plain_value(ctx.rank), extra=EXTRA)
    dcp.save(state, storage_writer=ckptstream.dcp.StreamWriter(path, **options))
    return state


class CollectorProbe(dcp.DefaultSavePlanner):
    """Notes whether the process's objects are frozen (out of the cyclic collector's scans) in
    each planning step of a save."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen: dict[str, bool] = {}

    def create_local_plan(self) -> Any:
        self.frozen["local"] = gc.get_freeze_count() > 0
        return super().create_local_plan()

    def create_global_plan(self, plans: Any) -> Any:
        self.frozen["global"] = gc.get_freeze_count() > 0
        return super().create_global_plan(plans)

    def finish_plan(self, plan: Any) -> Any:
        self.frozen["finish"] = gc.get_freeze_count() > 0
        return super().finish_plan(plan)

    def resolve_data(self, item: Any) -> Any:
        self.frozen["write"] = gc.get_freeze_count() > 0
        return super().resolve_data(item)


def frozen_while_planning(ctx: Ctx, state: dict[str, Any]) -> None:
    """The process's objects are frozen from the writer's set-up through the planning and the
    write on every rank (the coordinator unpickles the ranks' plans, then their results), and
    thawed when the save returns."""
    probe = CollectorProbe()
    assert gc.get_freeze_count() == 0
    writer = ckptstream.dcp.StreamWriter(ctx.workdir / "probed")  # alive: its end would thaw them too
    dcp.save(state, storage_writer=writer, planner=probe)
    want = {"local": True, "finish": True, "write": True, **({"global": True} if ctx.rank == 0 else {})}
    assert probe.frozen == want, (ctx.rank, probe.frozen)
    assert gc.get_freeze_count() == 0, "objects stayed frozen after the save"
    del writer


def scenario_reshard(ctx: Ctx) -> None:
    work = ctx.workdir
    if ctx.rank == 0:
        ref = {**global_tensors(), **{f"plain.{r}": plain_value(r) for r in range(ctx.world)}}
        ckptstream.save(ref, work / "reference.safetensors")
    state = save_sharded(ctx, work / "sharded")
    frozen_while_planning(ctx, state)
    for kind in ("shard1", "replicate"):
        loaded = target(ctx, kind)
        dcp.load(loaded, storage_reader=ckptstream.dcp.StreamReader(work / "sharded"))
        check_loaded(ctx, loaded, f"sharded -> {kind}")
    # 1 -> 2: the test saved work/single from one process
    for kind in ("shard1", "replicate"):
        loaded = target(ctx, kind)
        tensors = {"model": loaded["model"], "ints": loaded["ints"], "tiny": loaded["tiny"]}
        dcp.load(tensors, storage_reader=ckptstream.dcp.StreamReader(work / "single"))
        for key, value in flat(loaded).items():
            assert same_bits(value.full_tensor().cpu(), global_tensors()[key]), f"single -> {kind}: {key}"
    if has_hf_reader():
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        loaded = target(ctx, "replicate")
        tensors = {"model": loaded["model"], "ints": loaded["ints"], "tiny": loaded["tiny"]}
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(work / "sharded")))
        for key, value in flat(loaded).items():
            assert same_bits(value.full_tensor().cpu(), global_tensors()[key]), f"HuggingFaceStorageReader: {key}"
    save_async(ctx, state)
    own = rank_local(ctx.rank)
    dcp.save(ckptstream.dcp.as_sharded(own), storage_writer=ckptstream.dcp.StreamWriter(work / "own-shards"))
    target_own: dict[str, Any] = {"a": poisoned_like(own["a"]), "b": [poisoned_like(own["b"][0])]}
    dcp.load(ckptstream.dcp.as_sharded(target_own), storage_reader=ckptstream.dcp.StreamReader(work / "own-shards"))
    assert same_bits(target_own["a"], own["a"]), "as_sharded: a"
    assert same_bits(target_own["b"][0], own["b"][0]), "as_sharded: b"
    if ctx.rank == 0:
        refuse_dtensor(ctx, state)
    no_collectives(ctx)
    async_on_its_own_group(ctx)
    resave_fails_on_one_rank(ctx)  # last: rank 1's writes fail from there on


def save_async(ctx: Ctx, state: dict[str, Any]) -> None:
    """Each staging mode: the state changes right after staging, the files hold the values of
    the call (the test compares them with the synchronous save's, byte for byte)."""
    for mode in MODES:
        live = {**state, "model": {k: v.clone() for k, v in state["model"].items()},
                "ints": state["ints"].clone(), "tiny": state["tiny"].clone(), "plain": state["plain"].clone(),
                "scalar": state["scalar"].clone(), "extra": dict(state["extra"])}
        writer = ckptstream.dcp.StreamWriter(ctx.workdir / f"async-{mode}", mode=mode,
                                             settings=Settings(buffer_size=4096, num_buffers=2))
        future = dcp.async_save(live, storage_writer=writer)
        assert isinstance(future, Future), future  # the writer stages at once: no AsyncSaveResponse
        if mode != "device":  # "host": orders the change below after the copies into host memory
            assert writer.wait_staged(timeout=120), f"{mode} staging did not complete"
        with torch.no_grad():
            for value in flat(live).values():
                value.to_local().copy_(poisoned_like(value.to_local()))
            live["plain"].add_(1)
            live["scalar"].fill_(-1)
        live["extra"]["step"] = 999
        future.result(timeout=120)
        loaded = target(ctx, "shard1")
        dcp.load(loaded, storage_reader=ckptstream.dcp.StreamReader(ctx.workdir / f"async-{mode}"))
        check_loaded(ctx, loaded, f"async_save staging={mode}")


def refuse_dtensor(ctx: Ctx, state: dict[str, Any]) -> None:
    with pytest.raises(ckptstream.UnsupportedTypeError, match=r"^w: a DTensor .*ckptstream\.dcp\.StreamWriter"):
        ckptstream.save({"w": state["model"]["W"]}, ctx.workdir / "refused.safetensors")
    assert not (ctx.workdir / "refused.safetensors").exists()


def no_collectives(ctx: Ctx) -> None:
    """torch 2.9+: ranks that save without collectives are all plan index 0; the files are
    named by rank, each with its own metadata."""
    import inspect

    if "use_collectives" not in inspect.signature(dcp.save).parameters:
        return
    path = ctx.workdir / "no-collectives"
    placements = dict.fromkeys(global_tensors(), Shard(0))
    state = dstate(ctx, global_tensors(), placements, rank_plain=plain_value(0), extra=EXTRA)
    dcp.save(state, storage_writer=ckptstream.dcp.StreamWriter(path), use_collectives=False)
    dist.barrier()
    names = sorted(os.listdir(path))
    assert names == [f"__{r}.metadata" for r in range(ctx.world)] + [
        ckptstream.dcp.rank_file_name(r) for r in range(ctx.world)], names
    loaded = dstate(ctx, {k: poisoned_like(v) for k, v in global_tensors().items()}, placements,
                    rank_plain=poisoned_like(plain_value(0)), extra={"step": 0, "lr": 0.0, "names": [], "note": ""})
    dcp.load(loaded, storage_reader=ckptstream.dcp.StreamReader(path))
    for key, value in flat(loaded).items():
        assert same_bits(value.to_local().cpu(), flat(state)[key].to_local().cpu()), f"no collectives: {key}"


# --- FSDP2 + AdamW: a resume equal bit for bit to an uninterrupted run ---------------------

def build(ctx: Ctx, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch (2.4) has FSDP2 only here
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[attr-defined]

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 33),
                                torch.nn.GELU(), torch.nn.Linear(33, 8)).to(ctx.device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def train(ctx: Ctx, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        x, y = torch.randn(8, 16, generator=g).to(ctx.device), torch.randn(8, 8, generator=g).to(ctx.device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return losses


def scenario_fsdp(ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    total, cut = 6, 3
    model, opt = build(ctx, 0)
    reference = train(ctx, model, opt, range(total))

    model, opt = build(ctx, 0)
    before = train(ctx, model, opt, range(cut))
    assert all(same_bits(a, b) for a, b in zip(before, reference, strict=False)), "saving must not change training"
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=ckptstream.dcp.StreamWriter(ctx.workdir / "fsdp"))

    fresh, fresh_opt = build(ctx, 1)  # other weights, no optimizer state yet
    msd, osd = get_state_dict(fresh, fresh_opt)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ckptstream.dcp.StreamReader(ctx.workdir / "fsdp"))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = train(ctx, fresh, fresh_opt, range(cut, total))
    for step, (a, b) in enumerate(zip(after, reference[cut:], strict=True), cut):
        assert same_bits(a, b), f"step {step}: loss {a.item()!r} after the resume, {b.item()!r} without"


# --- a rank killed mid-save ----------------------------------------------------------------

def scenario_kill(ctx: Ctx) -> None:
    """Save a good checkpoint, then another into a second directory during which rank 1 is
    killed (SIGKILL) after a few of its data writes: rank 0 must not write .metadata."""
    big = torch.randn(2048, 256, generator=torch.Generator().manual_seed(SEED))
    state = {"big": distribute_tensor(big.to(ctx.device), ctx.mesh, [Shard(0)])}
    if ctx.rank == 0:
        ckptstream.save({"big": big}, ctx.workdir / "reference.safetensors")
    dcp.save(state, storage_writer=ckptstream.dcp.StreamWriter(ctx.workdir / "good"))
    dist.barrier()
    if ctx.rank == 1:
        real, calls = fileio.pwrite_all, []

        def pwrite_then_die(fd: int, view: memoryview, offset: int, path: str) -> None:
            real(fd, view, offset, path)
            calls.append(offset)
            if len(calls) == 4:  # the header and three chunks of data are in the temp file
                os.kill(os.getpid(), signal.SIGKILL)

        fileio.pwrite_all = pwrite_then_die
    writer = ckptstream.dcp.StreamWriter(ctx.workdir / "bad", settings=Settings(buffer_size=1 << 16, num_buffers=2,
                                                                                io_threads=1))
    try:
        dcp.save(state, storage_writer=writer)
    except Exception as e:  # rank 0: its peer is gone
        print(f"rank {ctx.rank}: the save failed as it should: {type(e).__name__}", flush=True)
        os._exit(3)
    raise AssertionError(f"rank {ctx.rank}: the save finished although rank 1 was killed")


# --- an async save on a process group of its own, training collectives beside it ---------

class GatedWriter(ckptstream.dcp.StreamWriter):
    """Holds its write until ``release`` is set, having set ``writing``: the save is in flight."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writing, self.release = threading.Event(), threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.writing.set()
        assert self.release.wait(120), "never released"
        return super().write_data(plan, planner)


def async_on_its_own_group(ctx: Ctx) -> None:
    """docs/dcp.md's pattern: dcp.async_save on a gloo group made for checkpoints, while the
    training's collectives run on the default group; they run while the save is in flight
    (its write held until they are done) and both complete."""
    save_group = dist.new_group(backend="gloo")  # every rank, once, in the same order
    full = torch.randn(64, 6, generator=torch.Generator().manual_seed(SEED + 3))
    state = {"w": distribute_tensor(full.to(ctx.device), ctx.mesh, [Shard(0)]), "step": 5}
    writer = GatedWriter(ctx.workdir / "async-group")
    future = dcp.async_save(state, storage_writer=writer, process_group=save_group)
    assert isinstance(future, Future), future
    assert writer.writing.wait(120), "the save never reached its write"
    total = torch.zeros(1, device=ctx.device)
    for step in range(20):  # the training's collectives, on the default group
        grad = torch.full((1,), float(step + ctx.rank), device=ctx.device)
        dist.all_reduce(grad)
        total += grad
    writer.release.set()
    future.result(timeout=120)
    assert total.item() == sum(2 * step + 1 for step in range(20)), total
    loaded: dict[str, Any] = {"w": distribute_tensor(poisoned_like(full).to(ctx.device), ctx.mesh, [Shard(0)]),
                              "step": 0}
    dcp.load(loaded, storage_reader=ckptstream.dcp.StreamReader(ctx.workdir / "async-group"))
    assert same_bits(loaded["w"].full_tensor().cpu(), full), "async save on its own group"
    assert loaded["step"] == 5


# --- a re-save of a complete directory that fails on one rank ------------------------------

def resave_fails_on_one_rank(ctx: Ctx) -> None:
    """Save A into work/resave, then B into the same directory, where rank 1's file write fails
    (ENOSPC at its first write): the save fails on both ranks; the test reads what is left."""
    from torch.distributed.checkpoint.api import CheckpointException

    path = ctx.workdir / "resave"
    for seed in (SEED + 1, SEED + 2):
        full = torch.randn(64, 6, generator=torch.Generator().manual_seed(seed))
        state = {"w": distribute_tensor(full.to(ctx.device), ctx.mesh, [Shard(0)])}
        writer = ckptstream.dcp.StreamWriter(path)
        if seed == SEED + 1:
            dcp.save(state, storage_writer=writer)
            dist.barrier()
            continue
        if ctx.rank == 1:
            def no_space(fd: int, view: memoryview, offset: int, path: str) -> None:
                raise OSError(errno.ENOSPC, "No space left on device (the test's)", path)

            fileio.pwrite_all = no_space
        try:
            dcp.save(state, storage_writer=writer)
        except CheckpointException as e:
            print(f"rank {ctx.rank}: the re-save failed as it should: {e!r}"[:300], flush=True)
        else:
            raise AssertionError(f"rank {ctx.rank}: the re-save finished although rank 1 could not write")


# --- GPU only: host memory stays bounded -------------------------------------------------

def synchronize(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def scenario_memory(ctx: Ctx) -> None:
    """A state of a few hundred MiB per rank, saved and loaded (into a destination already in
    memory): the host's RSS grows by at most the staging buffers + 64 MiB."""
    mib = 1 << 20
    options: dict[str, Any] = {"buffer_size": 16 * mib, "num_buffers": 4}
    staging = options["buffer_size"] * options["num_buffers"]
    g = torch.Generator(device=ctx.device).manual_seed(SEED + ctx.rank)
    shapes = [(4096, 4096)] * 4 + [(4096, 4097), (33, 4099)]  # ~320 MiB per rank in fp32 shards
    state = {f"p{i}": DTensor.from_local(torch.randn(s, generator=g, device=ctx.device), ctx.mesh, [Shard(0)])
             for i, s in enumerate(shapes)}
    # a first save and load of 4 MiB per rank: what is built on first use (the staging pool,
    # the GPU checksum kernel) is not the state's cost
    warm = {"w": DTensor.from_local(torch.randn(1024, 1024, device=ctx.device), ctx.mesh, [Shard(0)])}
    dcp.save(warm, storage_writer=ckptstream.dcp.StreamWriter(ctx.workdir / "warm", settings=Settings(**options)))
    dcp.load(warm, storage_reader=ckptstream.dcp.StreamReader(ctx.workdir / "warm", settings=Settings(**options)))
    synchronize(ctx)
    with PeakRss() as saving:
        dcp.save(state, storage_writer=ckptstream.dcp.StreamWriter(ctx.workdir / "big", settings=Settings(**options)))
    loaded = {k: DTensor.from_local(poisoned_like(v.to_local()), ctx.mesh, [Shard(0)]) for k, v in state.items()}
    with PeakRss() as loading:
        dcp.load(loaded, storage_reader=ckptstream.dcp.StreamReader(ctx.workdir / "big", settings=Settings(**options)))
        synchronize(ctx)
    for key in state:
        assert torch.equal(loaded[key].to_local(), state[key].to_local()), key
    limit = staging + 64 * mib
    print(f"rank {ctx.rank}: RSS +{saving.growth / mib:.0f} MiB saving, +{loading.growth / mib:.0f}"
          f" MiB loading, {sum(v.to_local().nbytes for v in state.values()) / mib:.0f} MiB of state", flush=True)
    assert saving.growth <= limit, f"save grew RSS by {saving.growth / mib:.0f} MiB"
    assert loading.growth <= limit, f"load grew RSS by {loading.growth / mib:.0f} MiB"


SCENARIOS = {"reshard": scenario_reshard, "fsdp": scenario_fsdp, "kill": scenario_kill, "memory": scenario_memory}


def main() -> None:
    scenario, rank, world, workdir, store, backend = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    device = torch.device("cpu")
    if backend != "gloo":
        device = torch.device("cuda", rank_i)
        torch.cuda.set_device(device)
        if os.environ.get("DCP_TEST_DETERMINISTIC"):  # the same kernels for the same inputs, run after run
            torch.use_deterministic_algorithms(True, warn_only=True)
        backend = "cpu:gloo,cuda:nccl"  # async_save needs a CPU backend
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank_i, world_size=world_i,
                            timeout=datetime.timedelta(seconds=60))
    start = time.monotonic()
    try:
        SCENARIOS[scenario](Ctx(rank_i, world_i, Path(workdir), device))
        dist.barrier()
    finally:
        print(f"rank {rank}: {scenario} took {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
