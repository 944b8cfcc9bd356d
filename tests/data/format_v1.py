"""The state of tests/data/format_v1.safetensors, rebuilt from its seed, and the script that
wrote that file with ckptstream 0.1.0 (torch only: it runs against any version of the library).

    PYTHONPATH=<0.1.0 source> python tests/data/format_v1.py tests/data/format_v1.safetensors
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch

SEED = 20260101
METADATA = {"run": "format-v1", "note": "ünïcode ✓"}


def state() -> dict[str, Any]:
    """Seeded random tensors of several dtypes, a tensor under two keys, views of one storage,
    an int key, an OrderedDict, a tuple and non-tensor leaves."""
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(8, 6, generator=g)
    emb = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    return {
        "model": collections.OrderedDict([
            ("w", w),
            ("w_t", w.t()),  # a view of w's storage
            ("emb", emb),
            ("head", emb),  # the same tensor again
            ("mask", torch.rand(13, generator=g) > 0.5),
            ("idx", torch.randint(-(2**40), 2**40, (3,), generator=g)),
        ]),
        "optim": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(6, generator=g).to(torch.float16)}},
        "step": 7,
        "lr": 0.25,
        "tags": ("a", None, True),
        "empty": torch.empty(0, 3),
    }


if __name__ == "__main__":
    import ckptstream

    ckptstream.save(state(), sys.argv[1], metadata=METADATA)
