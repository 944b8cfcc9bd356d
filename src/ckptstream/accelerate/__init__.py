"""ckptstream for Hugging Face Accelerate: ``StreamState(accelerator)`` makes
``accelerator.save_state`` / ``load_state`` write and read ckptstream files (docs/integrations.md).

Importing this module imports Accelerate (``import ckptstream`` does not); install it with
``pip install 'ckptstream[accelerate]'``.
"""

from __future__ import annotations

try:
    import accelerate  # noqa: F401
except ImportError as e:
    raise ImportError(
        "ckptstream.accelerate needs Hugging Face Accelerate (the `accelerate` package): install it with "
        "pip install 'ckptstream[accelerate]' (or pip install accelerate)"
    ) from e

from ._stream import AccelerateFolderError, StreamState, state_file

__all__ = ["AccelerateFolderError", "StreamState", "state_file"]
