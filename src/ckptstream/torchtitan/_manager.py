"""torchtitan's checkpointer, saving through ``ckptstream.dcp``.

torchtitan's ``CheckpointManager`` funnels every save and every load through two methods,
``dcp_save`` and ``dcp_load``, and the trainer builds whichever manager its ``checkpoint``
config names (``Config.build()``). So the integration is a subclass that overrides those two
methods and declares a ``Config`` of its own; the step folders, intervals, retention, resume
rule (the newest ``step-N`` with a ``.metadata``) and Hugging Face exports stay torchtitan's.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from ckptstream.dcp import StreamReader, StreamWriter, checkpoint_files

log = logging.getLogger(__name__)
StreamMode = Literal["device", "lazy", "host"]


class StreamCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's ``CheckpointManager``, its checkpoints written and read by ckptstream.

    Build it through torchtitan's config (``stream_checkpoints(config)`` or
    ``config.checkpoint = StreamCheckpointManager.Config(...)``). ``async_mode``:
    "disabled" (a synchronous ``dcp.save`` through ``StreamWriter``) or "async" (``dcp.async_save``
    on the checkpointer's own gloo group, staged by ``StreamWriter`` as ``stream_mode`` says).
    "async_with_pinned_mem" is refused: it stages a pinned host copy of the whole state in
    another process, which is what ckptstream's device staging avoids (``stream_mode="host"``
    is the pinned host copy, in this process). A step folder saved by torchtitan's default
    saver (``.distcp`` files) still loads, through torch's ``FileSystemReader``.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        stream_mode: StreamMode = "device"
        """What an async save reads in the background (ckptstream.AsyncMode): "device" (a
        snapshot in spare device memory), "lazy" (the live tensors, until the optimizer step
        waits for them) or "host" (a snapshot in host memory)."""

        checksum: bool = True
        """Store a CRC-32C of every chunk (verified by ``ckptstream verify``)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise ValueError(
                    "StreamCheckpointManager: checkpoint.async_mode='async_with_pinned_mem' stages a pinned host "
                    "copy of the whole state in another process; use async_mode='async' (ckptstream stages it, "
                    "on the device with stream_mode='device', in pinned host memory with stream_mode='host')")
            if self.stream_mode not in ("device", "lazy", "host"):
                raise ValueError(f"checkpoint.stream_mode must be 'device', 'lazy' or 'host', got {self.stream_mode!r}")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.stream_mode = config.stream_mode
        self.checksum = config.checksum
        self._staging: StreamWriter | None = None  # the async save whose tensors may still be read

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Future[Any] | None:
        if to_hf:  # a Hugging Face export: torchtitan's own writer and consolidation
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)  # type: ignore[no-any-return]
        writer = StreamWriter(checkpoint_id, mode=self.stream_mode, checksum=self.checksum)
        result: Future[Any] | None = None
        if async_mode == AsyncMode.ASYNC:
            # the writer is DCP's stager too: async_save returns once it staged (stream_mode)
            saving = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                    process_group=self.pg)
            assert isinstance(saving, Future)  # DCP's thread executor: one future, durable when done
            result = saving
            self._staging = writer
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _maybe_wait_for_staging(self) -> None:
        # the trainer calls this just before optimizer.step(): in "lazy" mode the write may still
        # be reading the live parameters and optimizer state
        writer, self._staging = self._staging, None
        if writer is not None:
            writer.wait_staged()

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or _saved_by_torch(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=StreamReader(checkpoint_id, checksum=self.checksum),
                 checkpoint_id=checkpoint_id)
        if MODEL in self.states:  # the model's keys are flattened into the state: torchtitan's rule
            self.states[MODEL].load_state_dict(state_dict)


def _saved_by_torch(checkpoint_id: str) -> bool:
    """Whether the step folder was written by torch's ``FileSystemWriter`` (torchtitan's default
    saver: ``.distcp`` data files), read without running code from it."""
    data = [f for f in checkpoint_files(checkpoint_id) if not f.endswith(".metadata")]
    if data and all(f.endswith(".distcp") for f in data):
        log.info("ckptstream.torchtitan: %s was saved by torch's FileSystemWriter; loading it with its reader",
                 checkpoint_id)
        return True
    return False


def stream_checkpoints(config: Any, *, stream_mode: StreamMode = "device", checksum: bool = True) -> Any:
    """Switch a torchtitan ``Trainer.Config`` to ``StreamCheckpointManager``, keeping every
    option of its ``checkpoint`` config (enable, folder, interval, async_mode, ...); returns it.

    Example, in a torchtitan config registry module (``--module mymodule --config debug``)::

        from torchtitan.models.llama3.config_registry import llama3_debugmodel
        from ckptstream.torchtitan import stream_checkpoints

        def debug():
            return stream_checkpoints(llama3_debugmodel())
    """
    old = config.checkpoint
    kept = {f.name: getattr(old, f.name) for f in dataclasses.fields(old)
            if f.name in {g.name for g in dataclasses.fields(StreamCheckpointManager.Config)}}
    config.checkpoint = StreamCheckpointManager.Config(**kept, stream_mode=stream_mode, checksum=checksum)
    return config
