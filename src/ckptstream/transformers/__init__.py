"""ckptstream for the Hugging Face Trainer: ``StreamTrainer`` in place of ``transformers.Trainer``
(or ``StreamCheckpointsMixin`` before a Trainer subclass) saves and resumes its checkpoints
through ckptstream, in the background by default (docs/integrations.md, "Hugging Face Trainer").

Importing this module imports transformers and Accelerate (``import ckptstream`` does not);
install them with ``pip install 'ckptstream[transformers]'``.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:
    raise ImportError(
        "ckptstream.transformers needs Hugging Face transformers (and Accelerate, which its Trainer needs): install "
        "them with pip install 'ckptstream[transformers]'"
    ) from e

from .._errors import TrainerFolderError
from ._folders import newest_complete, state_file
from ._trainer import StreamCheckpointsMixin, StreamTrainer

__all__ = ["StreamCheckpointsMixin", "StreamTrainer", "TrainerFolderError", "newest_complete", "state_file"]
