"""examples/train_gpt.py with the hooks of tests/test_resume.py.

    child_train.py [--dump-saved STEP FILE] [--dump-restored FILE] [--forget-rng] -- EXAMPLE ARGS...

--dump-saved     torch.save a copy of the live training state at the checkpoint of STEP
--dump-restored  torch.save a copy of the live training state right after the resume
--forget-rng     resume everything but the random number generators (a planted bug: the test
                 that runs it must see the losses go another way)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from tests.resume.trainutil import EXAMPLES, detached

sys.path.insert(0, str(EXAMPLES))
import train_gpt  # type: ignore[import-not-found]


def main(argv: list[str]) -> None:
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--dump-saved", nargs=2, metavar=("STEP", "FILE"))
    p.add_argument("--dump-restored")
    p.add_argument("--forget-rng", action="store_true")
    hooks = p.parse_args(argv[:split])
    real_state, real_restore = train_gpt.checkpoint_state, train_gpt.restore

    def checkpoint_state(run: Any, step: int, epoch: int, batch: int) -> Any:
        state = real_state(run, step, epoch, batch)
        if hooks.dump_saved and step == int(hooks.dump_saved[0]):
            torch.save(detached(state), hooks.dump_saved[1])
        return state

    def restore(run: Any, ckpts: Any) -> tuple[int, int, int]:
        position: tuple[int, int, int] = real_restore(run, ckpts)
        if hooks.dump_restored:
            torch.save(detached(real_state(run, *position)), hooks.dump_restored)
        return position

    train_gpt.checkpoint_state = checkpoint_state
    train_gpt.restore = restore
    if hooks.forget_rng:
        train_gpt.restore_rng = lambda rng: None
    train_gpt.main(argv[split + 1 :])


if __name__ == "__main__":
    main(sys.argv[1:])
