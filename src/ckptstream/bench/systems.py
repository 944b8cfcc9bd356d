"""The systems compared: how each saves a state and the ways each loads it back.

A load variant either returns a new state (``in_place=False``: it gets the saved state only to
know shapes) or fills a preallocated one (``in_place=True``: the benchmark allocates the target
before the clock starts, as a training job that already holds its model would). A variant that
loads to some devices only (``devices``) is not run on the others; a system with no variant for
the device is listed as not run, with ``devices_note`` as the reason. ``prepare`` (of a system,
for its saves; of a variant, for its targets) turns a state into the form the system takes
before the clock starts: DCP's users hold their state as DTensors already. A load-only system
(``timed_save=False``: the peers of ``peers.py``) writes its file once, before the clock.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

import ckptstream

from . import peers
from .measure import quiet_warnings
from .state import State, empty_like_state, flat_tensors, iter_tensors

Save = Callable[[Any, str, int], None]  # (prepared state, path, world size)
Load = Callable[[str, Any, str, int], Any]  # (path, saved state or prepared target, device, world size) -> state
Prepare = Callable[[State, int], Any]  # (state, world size) -> the state as the system takes it


def _as_it_is(state: State, world: int) -> Any:
    return state


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    load: Load
    in_place: bool = False
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it loads to
    prepare: Prepare = _as_it_is  # the target, before the clock (in place: the target is the result)


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    module: str  # must import for the system to run
    filename: str  # the checkpoint file in the system's directory ("" for a directory)
    save: Save
    variants: tuple[Variant, ...]
    prepare: Prepare = _as_it_is  # the state, before the clock
    timed_save: bool = True  # False: ``save`` writes the file to load, once and untimed (no save figure)
    devices_note: str = ""  # why it does not run on a device that none of its variants loads to

    def variants_on(self, device: str) -> tuple[Variant, ...]:
        """The load variants that run on ``device`` ("cpu", "cuda", "cuda:1")."""
        kind = device.split(":")[0]
        return tuple(v for v in self.variants if kind in v.devices)

    def path(self, directory: str, rank: int) -> str:
        if not self.filename:
            return os.path.join(directory, "checkpoint")
        return os.path.join(directory, f"rank{rank}.{self.filename}")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ckptstream: the checkpoint layer, defaults as a user gets them (checksums on, verified on load)
def _ck_save(state: State, path: str, world: int) -> None:
    ckptstream.save(state, path)


def _ck_load(path: str, like: Any, device: str, world: int) -> Any:
    return ckptstream.load(path, device=device)  # on the CPU: mapped, checksums verified


def _ck_load_unverified(path: str, like: Any, device: str, world: int) -> Any:
    return ckptstream.load(path, device=device, checksum=False)  # beside the row above: what verifying costs


def _ck_load_copied(path: str, like: Any, device: str, world: int) -> Any:
    return ckptstream.load(path, device=device, mmap=False)  # CPU only: copied into new memory


def _ck_load_into(path: str, target: Any, device: str, world: int) -> Any:
    return ckptstream.load_into(target, path)


# engine: the bare transfer primitive, tensors back to back, no header and no checksums
def _engine_save(state: State, path: str, world: int) -> None:
    with open(path, "wb") as f:
        for t in flat_tensors(state).values():
            ckptstream.device_to_file(t, f)
        os.fsync(f.fileno())


def _engine_load(path: str, like: Any, device: str, world: int) -> Any:
    out = empty_like_state(like, device)
    with open(path, "rb") as f:
        for t in flat_tensors(out).values():
            ckptstream.file_to_device(f, t)
    return out


def _torch_save(state: State, path: str, world: int) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: str, like: Any, device: str, world: int) -> Any:
    return torch.load(path, map_location=device, weights_only=True)


def _torch_load_mmap(path: str, like: Any, device: str, world: int) -> Any:
    return torch.load(path, map_location=device, weights_only=True, mmap=True)


def _st_save(state: State, path: str, world: int) -> None:
    from safetensors.torch import save_file

    # safetensors takes a flat {name: tensor} dict; the step goes into its string metadata
    save_file(flat_tensors(state), path, metadata={"step": str(state.get("step", 0))})
    fsync_path(path)  # save_file does not fsync


def _st_load(path: str, like: Any, device: str, world: int) -> Any:
    from safetensors.torch import load_file

    return load_file(path, device=device)


_mesh: Any = None


def _dcp_state(state: Any, world: int) -> Any:
    """The state as DCP sees it: with several ranks, each rank's tensors as its shard of one
    global DTensor (sharded on dimension 0), as FSDP2 and ZeRO states are; with one, as it is."""
    global _mesh
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from ckptstream.dcp import as_sharded

        if _mesh is None:
            device_type = next(t.device.type for _, t in iter_tensors(state))
            _mesh = init_device_mesh(device_type, (world,))
        return as_sharded(state, _mesh)
    return state if isinstance(state, dict) else {"state": state}


def _single_process(dcp_call: Callable[..., Any], world: int) -> dict[str, bool]:
    """DCP's ``no_dist=True`` for one rank. torch 2.4's save and load have no such argument:
    without a process group they run in one process by themselves (with a warning)."""
    return {"no_dist": world == 1} if "no_dist" in inspect.signature(dcp_call).parameters else {}


def _dcp_save_with(writer: Any) -> Save:
    def save(state: Any, path: str, world: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        with quiet_warnings():
            dcp_save(state, storage_writer=writer(path), **_single_process(dcp_save, world))

    return save


def _dcp_load_with(reader: Any) -> Load:
    def load(path: str, wrapped: Any, device: str, world: int) -> Any:
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        with quiet_warnings():
            dcp_load(wrapped, storage_reader=reader(path), **_single_process(dcp_load, world))  # fills the target
        return wrapped

    return load


def _fs_writer(path: str) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    return FileSystemWriter(path)


def _fs_reader(path: str) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(path)


def _stream_writer(path: str) -> Any:
    from ckptstream.dcp import StreamWriter

    return StreamWriter(path)


def _stream_reader(path: str) -> Any:
    from ckptstream.dcp import StreamReader

    return StreamReader(path)


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("ckptstream", "ckptstream", "safetensors", _ck_save,
               (Variant("ckptstream", _ck_load), Variant("ckptstream load_into", _ck_load_into, in_place=True),
                Variant("ckptstream checksum=False", _ck_load_unverified),
                Variant("ckptstream mmap=False", _ck_load_copied, devices=("cpu",)))),
        System("engine", "ckptstream", "bin", _engine_save, (Variant("engine", _engine_load),)),
        System("torch", "torch", "pt", _torch_save,
               (Variant("torch", _torch_load), Variant("torch mmap", _torch_load_mmap))),
        System("safetensors", "safetensors.torch", "safetensors", _st_save, (Variant("safetensors", _st_load),)),
        System("dcp", "torch.distributed.checkpoint", "", _dcp_save_with(_fs_writer),
               (Variant("dcp", _dcp_load_with(_fs_reader), in_place=True, prepare=_dcp_state),), _dcp_state),
        # DCP with ckptstream as its storage (StreamWriter / StreamReader)
        System("dcp-stream", "torch.distributed.checkpoint", "", _dcp_save_with(_stream_writer),
               (Variant("dcp-stream", _dcp_load_with(_stream_reader), in_place=True, prepare=_dcp_state),),
               _dcp_state),
    )
}
SYSTEMS.update({
    s.name: s
    for s in (
        System("fastsafetensors", "fastsafetensors", "safetensors", peers.write_safetensors,
               (Variant("fastsafetensors", peers.fastsafetensors_load),), timed_save=False),
        System("instanttensor", "instanttensor", "safetensors", peers.write_safetensors,
               (Variant("instanttensor", peers.instanttensor_loader(buffered=False), devices=("cuda",)),
                Variant("instanttensor buffered", peers.instanttensor_loader(buffered=True), devices=("cuda",))),
               timed_save=False, devices_note="InstantTensor loads into CUDA devices only (its safe_open refuses "
                                              "any other device)"),
        System("runai-streamer", "runai_model_streamer", "safetensors", peers.write_safetensors,
               (Variant("runai-streamer", peers.runai_load),), timed_save=False),
        System("tensorizer", "tensorizer", "tensors", peers.tensorizer_save,
               (Variant("tensorizer", peers.tensorizer_load),), timed_save=False),
    )
})
DEFAULT = ("ckptstream", "torch", "safetensors", "dcp")
DEFAULT_RANKS = (*DEFAULT, "dcp-stream")  # several ranks: DCP's own storage against ckptstream's
# the fast loaders of the ``bench-peers`` extra: run when named (--systems), each its own package
LOAD_PEERS = ("fastsafetensors", "instanttensor", "runai-streamer", "tensorizer")
PEERS = ("torch", "safetensors", "dcp", *LOAD_PEERS)


def not_installed(name: str, error: BaseException | None = None) -> str:
    detail = f" ({error})" if error else ""
    return f"{name} skipped: {SYSTEMS[name].module} is not installed{detail}"


def unavailable(name: str, device: str) -> str | None:
    """Why system ``name`` cannot run here on ``device``, or None when it seems it can. Only looks
    the module up (importing DCP takes seconds); the worker imports it and reports a failing import."""
    system = SYSTEMS[name]
    if not system.variants_on(device):
        return f"{name} skipped: {system.devices_note or f'it has no load to {device}'}"
    try:
        if importlib.util.find_spec(system.module) is None:
            return not_installed(name)
    except ImportError as e:
        return not_installed(name, e)
    return None
