"""torchtitan's own entry point on one GPU: the kill-and-resume test of
tests/test_torchtitan_resume.py (the llama3 debug model, 24 steps, a checkpoint every 3 through
``StreamCheckpointManager`` with ``async`` and ``stream_mode=device``: the snapshot is taken in
GPU memory, 5 SIGKILLs, torchtitan's resume) with the model on the GPU and NCCL, in
torchtitan's deterministic mode (deterministic cuBLAS and cuDNN, so that an uninterrupted run is
a reference to compare with bit for bit). The launcher leaves the device alone where CUDA is
present and adds ``torch.distributed.set_timeout`` where torch lacks it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.test_torchtitan_resume import kill_and_resume
from tests.test_torchtitan_resume import pytestmark as needs_torchtitan

pytestmark = [pytest.mark.gpu, needs_torchtitan]


@pytest.mark.timeout(1500)
def test_killed_torchtitan_runs_resume_bit_for_bit_on_a_gpu(tmp_path: Path) -> None:
    try:
        with warnings.catch_warnings():  # torch 2.11 deprecates torch.jit.script_method, which its own mkldnn uses
            warnings.simplefilter("ignore", DeprecationWarning)
            import torchtitan.trainer  # noqa: F401
    except ImportError as e:  # torchtitan 0.3.0 under torch 2.11: "cannot import name 'DataParallelMeshDims'"
        import torch

        pytest.skip(f"torchtitan's trainer does not import under torch {torch.__version__}: {e}")
    kill_and_resume(tmp_path, ("--debug.deterministic",))
