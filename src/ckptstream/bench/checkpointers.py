"""The ways to checkpoint that the stall benchmark (``training.py``) compares: how each starts a
checkpoint of the live training state, what the loop must wait for before its next update,
and when the file is durable.

ckptstream's ``save`` and ``save_async`` modes, and a ``CheckpointManager`` step in device mode
(a step folder, its rank's file and its ``DONE``); ``torch.save`` in a thread after a CPU copy;
DCP ``async_save`` with its default stager, or with ``DefaultStager(StagingOptions(True, True,
True, True))`` (pinned shared memory, staging in the background: torchtitan's
"async_with_pinned_mem"); and, from the ``bench-peers`` extra, nvidia-resiliency-ext's
``TorchAsyncCheckpoint`` (its documented async ``torch.save`` of a plain state dict, written by a
persistent worker process).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import ckptstream

SYSTEMS = ("sync", "device", "lazy", "host", "manager.device", "torch.save+thread", "dcp.async_save",
           "dcp.async_save+pinned")
PEER_SYSTEMS = ("nvrx.async_save",)  # needs its package (the bench-peers extra) and CUDA: run when named
ALL_SYSTEMS = SYSTEMS + PEER_SYSTEMS
OURS = ("device", "lazy", "host")
State = dict[str, torch.Tensor]


class Job:
    """A checkpoint in flight: ``gate`` before the next update, ``done``, and when it was durable
    (``durable_at``: a ``time.perf_counter()`` reading, asked once ``finish`` returned)."""

    def __init__(self, done: Callable[[], bool], durable_at: Callable[[], float | None],
                 gate: Callable[[], None] | None = None, finish: Callable[[], Any] = lambda: None) -> None:
        self.done, self.durable_at, self.gate, self.finish = done, durable_at, gate, finish


Start = Callable[[State, str], Job]  # (live state, path) -> the checkpoint in flight


def _thread_job(work: Callable[[], None]) -> Job:
    ended: list[float] = [0.0]
    error: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:
            error.append(e)
        ended[0] = time.perf_counter()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def finish() -> None:
        thread.join()
        if error:
            raise error[0]

    return Job(lambda: not thread.is_alive(), lambda: ended[0], finish=finish)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(state: State, path: str) -> Job:
    cpu = {k: v.detach().cpu() for k, v in state.items()}  # the copy the peers make first

    def write() -> None:
        with open(path, "wb") as f:
            torch.save(cpu, f)
            f.flush()
            os.fsync(f.fileno())

    return _thread_job(write)


def _pinned_stager() -> Any:
    """torchtitan's "async_with_pinned_mem": ``StagingOptions(True, True, True, True)``. Pinned
    memory and non-blocking copies need CUDA: on a CPU-only torch those two are off."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        raise ImportError(f"dcp.async_save+pinned needs torch 2.9 or later (DCP's DefaultStager); this is "
                          f"torch {torch.__version__}") from e
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


def _dcp(state: State, path: str, pinned: bool) -> Job:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    ended, recorded = [0.0], threading.Event()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's stager: no pinned memory without CUDA
        if pinned:
            response: Any = async_save(state, checkpoint_id=path, async_stager=_pinned_stager())
            upload, staging = response.upload_completion, response.staging_completion
        else:
            upload, staging = async_save(state, checkpoint_id=path), None

    def durable(_: Any) -> None:
        ended[0] = time.perf_counter()
        recorded.set()

    upload.add_done_callback(durable)  # callbacks may run after result() returns: wait for it
    gate = (lambda: staging.result()) if staging is not None else None
    return Job(upload.done, lambda: ended[0] if recorded.wait() else None, gate, upload.result)


def _handle_job(h: ckptstream.SaveHandle, began: float, finish: Callable[[], Any]) -> Job:
    def durable_at() -> float | None:
        return None if h.seconds_to_durable is None else began + h.seconds_to_durable

    return Job(h.done, durable_at, h.wait_staged, finish)


def _manager_step(state: State, path: str) -> Job:
    """Step 1 of a manager whose folder is ``path``; durable once its DONE is."""
    began = time.perf_counter()
    manager = ckptstream.CheckpointManager(path, keep=1, mode="device")
    h = manager.save(state, 1)

    def finish() -> None:
        try:
            h.result()
        finally:
            manager.close()

    return _handle_job(h, began, finish)


def start(system: str, state: State, path: str) -> Job:
    """Start checkpoint ``system`` of ``state`` at ``path`` (a file, or a folder for DCP); the
    systems of SYSTEMS, which need no setup (see ``session`` for all)."""
    if system == "sync":
        ckptstream.save(state, path)
        durable = time.perf_counter()
        return Job(lambda: True, lambda: durable)
    if system in OURS:
        began = time.perf_counter()
        h = ckptstream.save_async(state, path, mode=system)
        return _handle_job(h, began, h.result)
    if system == "manager.device":
        return _manager_step(state, path)
    if system == "torch.save+thread":
        return _torch_save(state, path)
    if system.startswith("dcp.async_save"):
        return _dcp(state, path, pinned=system.endswith("+pinned"))
    raise ValueError(f"unknown system {system!r}; known: {list(ALL_SYSTEMS)}")


@contextlib.contextmanager
def session(system: str, device: torch.device) -> Iterator[Start]:
    """How to start checkpoints of ``system`` in this process, with what it sets up once per
    training job (a worker process, a process group) ready and torn down after."""
    if system == "nvrx.async_save":
        with _nvrx(device) as begin:
            yield begin
        return
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {list(ALL_SYSTEMS)}")
    if system.startswith("dcp"):  # its import is not part of a checkpoint
        import torch.distributed.checkpoint.state_dict_saver  # noqa: F401
    yield lambda state, path: start(system, state, path)


@contextlib.contextmanager
def _nvrx(device: torch.device) -> Iterator[Start]:
    """nvidia-resiliency-ext's ``TorchAsyncCheckpoint(persistent_queue=True)``: ``async_save``
    copies the state to host memory, then its worker process runs ``torch.save``. Its worker is
    started before the first checkpoint (``AsyncCallsQueue.warmup_persistent_caller``, where the
    version has it), as a training job does once. Its ``torch.save`` does not fsync: the
    benchmark fsyncs the file in a thread of its own once the worker reports it written."""
    if device.type != "cuda":
        raise RuntimeError("nvrx.async_save needs a CUDA device: nvidia-resiliency-ext's TorchAsyncCheckpoint "
                           "synchronizes CUDA after its copy to the host, and its worker process runs on a GPU")
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
    except ImportError as e:
        raise ImportError(f"nvrx.async_save needs nvidia-resiliency-ext (pip install 'ckptstream[bench-peers]'): "
                          f"{e}") from e
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:  # its queue asks for the process's rank: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        warm_up = getattr(AsyncCallsQueue, "warmup_persistent_caller", None)
        if warm_up is not None:
            warm_up(0)
        checkpointer = TorchAsyncCheckpoint(persistent_queue=True)
        try:
            yield lambda state, path: _nvrx_job(checkpointer, state, path)
        finally:
            checkpointer.finalize_async_save(blocking=True, no_dist=True, terminate=True)
    finally:
        if created:
            dist.destroy_process_group()


def _nvrx_job(checkpointer: Any, state: State, path: str) -> Job:
    checkpointer.async_save(state, path)
    queue = checkpointer._async_calls_queue  # its only way to ask whether the write has ended
    synced: list[threading.Thread] = []
    durable, error = [0.0], []

    def sync() -> None:
        try:
            _fsync(path)
        except OSError as e:
            error.append(e)
        durable[0] = time.perf_counter()

    def done() -> bool:
        if not synced:
            checkpointer.finalize_async_save(blocking=False, no_dist=True)
            if queue.get_num_unfinalized_calls():
                return False
            synced.append(threading.Thread(target=sync, daemon=True))
            synced[0].start()
        return not synced[0].is_alive()

    def finish() -> None:
        checkpointer.finalize_async_save(blocking=True, no_dist=True)
        done()
        synced[0].join()
        if error:
            raise error[0]

    return Job(done, lambda: durable[0], finish=finish)
