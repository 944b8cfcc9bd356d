"""Two MULTI_CPU processes saving with ``total_limit=2`` through a StreamState, where the other
rank's background saves write only when that rank waits for them (its ``save_async`` deferred
so): tests/test_accelerate_ranks.py checks that the main process removes an old folder only
once every rank's file of the newer ones is there.

    child_accelerate_limit.py PROJECT
    Saves 4 times with automatic naming; after each ``save_state`` the main process writes to
    PROJECT.seen the folders it finds and which of them hold both ranks' files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import ckptstream.accelerate._stream as stream_module
from ckptstream import save
from ckptstream.accelerate import StreamState, state_file


class Deferred:
    """A background save that has not begun writing: it writes when waited for."""

    def __init__(self, state: Any, path: str, checksum: bool) -> None:
        self.state, self.path, self.checksum, self.written = state, path, checksum, False

    def staged(self) -> bool:
        return True

    def wait_staged(self, timeout: float | None = None) -> None:
        pass

    def result(self, timeout: float | None = None) -> None:
        if not self.written:
            save(self.state, self.path, checksum=self.checksum)
            self.written = True


def main(project: str) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project, total_limit=2,
                                                                      automatic_checkpoint_naming=True))
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    if acc.process_index == 1:
        stream_module.save_async = lambda state, path, **kw: Deferred(state, path, kw["checksum"])  # type: ignore
    checkpoints, seen = Path(project) / "checkpoints", []
    with StreamState(acc, mode="device"):
        for _ in range(4):
            acc.backward(model(torch.randn(2, 4)).sum())
            opt.step()
            acc.save_state()
            if acc.is_main_process:
                folders = sorted(os.listdir(checkpoints))
                whole = [f for f in folders if all(state_file(checkpoints / f, r).is_file() for r in (0, 1))]
                seen.append(f"{' '.join(folders)} | {' '.join(whole)}")
            acc.wait_for_everyone()
    if acc.is_main_process:
        Path(f"{project}.seen").write_text("\n".join(seen))
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
