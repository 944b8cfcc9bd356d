"""ckptstream for Lightning: ``Trainer(plugins=[StreamCheckpointIO()])`` writes every checkpoint
as a ckptstream file (docs/integrations.md).

Importing this module imports Lightning (``import ckptstream`` does not); install it with
``pip install 'ckptstream[lightning]'``.
"""

from __future__ import annotations

try:
    import lightning.fabric.plugins  # noqa: F401
except ImportError as e:
    raise ImportError(
        "ckptstream.lightning needs Lightning (the `lightning` package): install it with "
        "pip install 'ckptstream[lightning]' (or pip install lightning)"
    ) from e

from .._errors import StorageOptionsError, UnsupportedPathError
from ._io import StreamCheckpointIO
from ._values import TYPES_KEY

__all__ = ["TYPES_KEY", "StorageOptionsError", "StreamCheckpointIO", "UnsupportedPathError"]
