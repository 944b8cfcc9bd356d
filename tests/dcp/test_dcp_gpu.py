"""ckptstream.dcp on 2 GPUs with NCCL (and gloo beside it, which async_save needs): the jobs of
test_dcp_ranks with CUDA DTensors and an FSDP2 model on the GPUs, plus the host memory that a
save and a load of a few hundred MiB per rank take. Run with ``pytest -m gpu tests/dcp``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptstream.dcp
from tests.dcp.dcp_helpers import check_full, destination, global_tensors, load_1, nested, run_ranks, save_1

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "DCP_TEST_DETERMINISTIC": "1"}


def test_cuda_dtensors_save_reshard_and_async(tmp_path: Path) -> None:
    """dcp_worker.scenario_reshard on CUDA: Shard(0) saved, loaded as Shard(1) and Replicate on
    the GPUs, a 1-process save loaded by 2 GPUs, async_save in each staging mode with the
    tensors overwritten right after staging ("device": snapshots on the GPU)."""
    save_1(nested(global_tensors()), tmp_path / "single")
    run_ranks("reshard", tmp_path, backend="nccl", timeout=300)
    check_full(load_1(destination(), tmp_path / "sharded"))
    for mode in ("device", "lazy", "host"):
        for rank in range(2):
            name = ckptstream.dcp.rank_file_name(rank)
            assert (tmp_path / f"async-{mode}" / name).read_bytes() == (tmp_path / "sharded" / name).read_bytes()


def test_fsdp2_on_gpus_resumes_bit_exact(tmp_path: Path) -> None:
    run_ranks("fsdp", tmp_path, backend="nccl", timeout=300, env=DETERMINISTIC)
    for rank in range(2):
        with safe_open(str(tmp_path / "fsdp" / ckptstream.dcp.rank_file_name(rank)), framework="pt") as f:
            assert any(k.startswith("model.") for k in f.keys())  # noqa: SIM118


def test_host_memory_stays_bounded(tmp_path: Path) -> None:
    """dcp_worker.scenario_memory: ~320 MiB per rank saved and loaded; each rank's RSS grows by
    at most the staging buffers + 64 MiB."""
    outputs = run_ranks("memory", tmp_path, backend="nccl", timeout=300)
    print("\n".join(line for out in outputs for line in out.splitlines() if "RSS" in line))
