"""torchtitan config registry functions for tests/resume/child_torchtitan.py (``--module titan_configs``):
torchtitan's llama3 debug model made to train on a CPU in seconds (SDPA attention, as FlexAttention
has no backward on a CPU; 64-token sequences, batches of 2, no validation)."""

from __future__ import annotations

from typing import Any

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from ckptstream.torchtitan import stream_checkpoints


def cpu_debugmodel() -> Any:
    """torchtitan's own saver (its CheckpointManager)."""
    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size = 64, 2
    config.validator.enable = False
    config.debug.seed = 0
    return config


def cpu_stream() -> Any:
    """The same, checkpointed through ckptstream."""
    return stream_checkpoints(cpu_debugmodel())
