"""ckptstream for torchtitan: ``StreamCheckpointManager`` is torchtitan's ``CheckpointManager``
with its DCP saves written by ``ckptstream.dcp.StreamWriter`` (``async_mode="async"``: staged by
ckptstream, on the device by default) and its resumes read by ``ckptstream.dcp.StreamReader``.
``stream_checkpoints(config)`` switches a torchtitan ``Trainer.Config`` over (docs/integrations.md).

Importing this module imports torchtitan (``import ckptstream`` does not); install it with
``pip install 'ckptstream[torchtitan]'``.
"""

from __future__ import annotations

try:
    import torchtitan.components.checkpoint  # noqa: F401
except ImportError as e:
    raise ImportError(
        "ckptstream.torchtitan needs torchtitan (the `torchtitan` package, 0.3 or later): install it with "
        "pip install 'ckptstream[torchtitan]' (or pip install torchtitan)"
    ) from e

from ._manager import StreamCheckpointManager, stream_checkpoints

__all__ = ["StreamCheckpointManager", "stream_checkpoints"]
