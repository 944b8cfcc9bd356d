"""ckptstream.dcp on real 2-rank gloo groups (the ranks are processes, see dcp_worker.py):
DTensors saved Shard(0) and loaded as Shard(1), Replicate and full in one process, a
one-process save loaded by 2 ranks, async_save in every staging mode, FSDP2 + AdamW resumed bit
for bit, a rank killed mid-save, a corrupted rank file."""

from __future__ import annotations

import io
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import ckptstream
import ckptstream.dcp
from tests.dcp.dcp_helpers import (
    EXTRA,
    SEED,
    box,
    check_full,
    destination,
    finish_ranks,
    flip_byte,
    global_tensors,
    has_hf_reader,
    load_1,
    nested,
    poisoned_like,
    raises_in_dcp,
    raises_metadata_error,
    rank_local,
    reference,
    run_ranks,
    same_bits,
    save_1,
    sharding_info,
    start_ranks,
    torch_version,
)

MODES = ("device", "lazy", "host")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank job of dcp_worker.scenario_reshard, which asserts in the ranks: Shard(0) saved
    and loaded as Shard(1) and Replicate, the 1-rank save below loaded by 2 ranks, the rank
    files through torch's HuggingFaceStorageReader (2.9+), each async_save staging mode with
    the state changed right after staging, use_collectives=False (2.9+), the DTensor refusal
    of ckptstream.save, an async save on a group of its own beside training collectives, and
    (last) a re-save into a complete directory that fails on rank 1."""
    work = tmp_path_factory.mktemp("reshard")
    save_1(nested(global_tensors()), work / "single")
    run_ranks("reshard", work)
    return work


def test_two_ranks_save_and_reshard(resharded: Path) -> None:
    names = sorted(p.name for p in (resharded / "sharded").iterdir())
    assert names == [".metadata", "rank-00000.safetensors", "rank-00001.safetensors"]


def test_rank_files_are_safetensors_holding_the_saved_chunks(resharded: Path) -> None:
    ref = reference(resharded)
    covered = dict.fromkeys(global_tensors(), 0)
    for rank in range(2):
        path = resharded / "sharded" / ckptstream.dcp.rank_file_name(rank)
        offsets = sharding_info(path)
        with safe_open(str(path), framework="pt") as f:
            assert set(f.keys()) == set(offsets)
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                stored = f.get_tensor(key)
                if key in covered:
                    assert same_bits(stored, box(ref[key], offsets[key], stored.shape)), key
                    covered[key] += stored.numel()
                elif key.startswith("extra."):
                    assert torch.load(io.BytesIO(stored.numpy().tobytes()), weights_only=True) == EXTRA[key[6:]]
                elif key == "plain":
                    assert any(same_bits(stored, ref[f"plain.{r}"]) for r in range(2))
                else:
                    assert key == "scalar", key
                    assert same_bits(stored, torch.tensor(3.5))
        with ckptstream.open(path) as reader:
            assert reader.checksummed
            assert reader.header.data_start % 4096 == 0
            assert all(e.offset % e.dtype.itemsize == 0 for e in reader.entries())
            reader.verify()
    assert covered == {k: v.numel() for k, v in global_tensors().items()}  # every element, once


def test_two_ranks_load_in_one_process(resharded: Path) -> None:
    check_full(load_1(destination(), resharded / "sharded"))


def test_own_shards_as_one_sharded_state(resharded: Path) -> None:
    """Each rank's own tensors wrapped by as_sharded: one global tensor, the ranks' stacked."""
    want: dict[str, Any] = {"a": torch.cat([rank_local(r)["a"] for r in range(2)]),
                            "b": [torch.cat([rank_local(r)["b"][0] for r in range(2)])]}
    got = load_1({"a": poisoned_like(want["a"]), "b": [poisoned_like(want["b"][0])]}, resharded / "own-shards")
    assert same_bits(got["a"], want["a"])
    assert same_bits(got["b"][0], want["b"][0])
    assert ckptstream.dcp.checkpoint_files(resharded / "own-shards") == [
        str(resharded / "own-shards" / n) for n in (".metadata", "rank-00000.safetensors", "rank-00001.safetensors")]


def test_dcp_to_torch_save_of_two_ranks(resharded: Path, tmp_path: Path) -> None:
    """Every rank's chunks put back together into the global tensors, with the non-tensor
    values, in one torch.save file (through DCP's _EmptyStateDictLoadPlanner and StreamReader)."""
    ckptstream.dcp.dcp_to_torch_save(resharded / "sharded", tmp_path / "state.pt")
    check_full(torch.load(tmp_path / "state.pt", weights_only=True))


@pytest.mark.skipif(not has_hf_reader(), reason=f"torch {torch.__version__} has no HuggingFaceStorageReader")
def test_hugging_face_reader_reads_two_ranks_in_one_process(resharded: Path) -> None:
    """torch's HuggingFaceStorageReader builds its metadata from the rank files' headers: every
    tensor comes back whole; a non-tensor value comes back as the U8 tensor of its torch.save
    bytes (the reader reads tensors only)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=HuggingFaceStorageReader(str(resharded / "sharded")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    for key, value in global_tensors().items():
        assert same_bits(loaded[key], value), key
    assert torch.load(io.BytesIO(loaded["extra.step"].numpy().tobytes()), weights_only=True) == EXTRA["step"]


@pytest.mark.skipif(not has_hf_reader(), reason=f"torch {torch.__version__} has no safetensors consolidation")
def test_hugging_face_consolidation_of_two_ranks(resharded: Path, tmp_path: Path) -> None:
    """torch's consolidate_safetensors_files merges the ranks' chunks of floating-point tensors
    into one safetensors file (it sizes elements with torch.finfo: integer tensors it cannot)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    floats = ["model.W", "model.V", "model.H", "tiny"]
    (tmp_path / "out").mkdir()
    consolidate_safetensors_files(str(resharded / "sharded"), str(tmp_path / "out"),
                                  fqn_to_index_mapping=dict.fromkeys(floats, 1))
    merged = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    assert sorted(merged) == sorted(floats)
    for key in floats:
        assert same_bits(merged[key], global_tensors()[key]), key


@pytest.mark.parametrize("mode", MODES)
def test_async_save_writes_the_same_files(resharded: Path, mode: str) -> None:
    for rank in range(2):
        name = ckptstream.dcp.rank_file_name(rank)
        assert (resharded / f"async-{mode}" / name).read_bytes() == (resharded / "sharded" / name).read_bytes()
    check_full(load_1(destination(), resharded / f"async-{mode}"))


@pytest.mark.parametrize("key", ["model.W", "extra.step"])
def test_corrupted_rank_file_names_file_and_tensor(resharded: Path, tmp_path: Path, key: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resharded / "sharded", ckpt)
    path = next(p for p in sorted(ckpt.glob("rank-*")) if key in sharding_info(p))
    with ckptstream.open(path) as reader:
        entry = reader.entry((key,))
    flip_byte(path, entry.offset + entry.nbytes // 2)
    raises_in_dcp(ckptstream.CorruptCheckpointError, rf"^{path}: tensor '{key}' fails its CRC-32C check", load_1,
                  destination(), ckpt)
    load_1(destination(), ckpt, checksum=False)  # the flag is what checks


def test_corrupted_header_names_the_file(resharded: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resharded / "sharded", ckpt)
    path = ckpt / ckptstream.dcp.rank_file_name(1)
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"ckptstream.crc32c":"') + len(b'"ckptstream.crc32c":"')  # valid JSON, another checksum
    raw[at] = ord("1") if raw[at] != ord("1") else ord("2")
    path.write_bytes(raw)
    raises_in_dcp(ckptstream.CorruptCheckpointError, f"^{path}: the header fails its CRC-32C check", load_1,
                  destination(), ckpt)


def test_async_save_on_its_own_group_beside_training_collectives(resharded: Path) -> None:
    """dcp_worker.async_on_its_own_group: docs/dcp.md's async pattern with process_group= of a
    gloo group made for checkpoints, 20 all_reduces on the default group while the save is in
    flight; both complete and the checkpoint loads bit for bit (checked in the ranks)."""
    assert sorted(p.name for p in (resharded / "async-group").iterdir()) == [
        ".metadata", "rank-00000.safetensors", "rank-00001.safetensors"]


def test_failed_resave_of_a_complete_directory_leaves_no_checkpoint(resharded: Path) -> None:
    """dcp_worker.resave_fails_on_one_rank: two ranks save A, then re-save B into the same
    directory and rank 1 fails writing its file. Rank 0's file of B is in place; the old
    .metadata must not be, or the directory would read as A's checkpoint with B's rank 0 in it.
    (tests/dcp/test_dcp_durability.py traces the order of the calls that make this so.)"""
    ckpt = resharded / "resave"
    names = sorted(os.listdir(ckpt))
    assert ".metadata" not in names, names
    assert "rank-00000.safetensors" in names, names
    with ckptstream.open(ckpt / "rank-00000.safetensors") as reader:  # rank 0's rows of B: the new save landed
        b_rows = torch.randn(64, 6, generator=torch.Generator().manual_seed(SEED + 2))[:32]
        assert same_bits(reader.read("w"), b_rows)
    raises_metadata_error(FileNotFoundError, r"no \.metadata: not a complete DCP checkpoint", load_1,
                          {"w": torch.zeros(64, 6)}, ckpt)
    assert not [n for n in names if ".ckptstream-tmp-" in n], names


@pytest.mark.skipif(torch_version() < (2, 7), reason=f"torch {torch.__version__}'s FSDP2 needs CUDA on a gloo group "
                    "(its collectives record events on a stream, which the CPU's have from 2.7)")
def test_fsdp2_adamw_resume_is_bit_exact(tmp_path: Path) -> None:
    """dcp_worker.scenario_fsdp: losses after get_state_dict -> save -> load into a fresh model
    -> set_state_dict equal those of an uninterrupted run, bit for bit."""
    run_ranks("fsdp", tmp_path)
    files = sorted(p.name for p in (tmp_path / "fsdp").iterdir())
    assert files == [".metadata", "rank-00000.safetensors", "rank-00001.safetensors"]
    for name in files[1:]:
        with safe_open(str(tmp_path / "fsdp" / name), framework="pt") as f:
            assert any(k.startswith("optim.state.") and k.endswith("exp_avg") for k in f.keys())  # noqa: SIM118


def test_rank_killed_mid_save_leaves_no_checkpoint(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed after a few of its data writes (dcp_worker.scenario_kill): no
    .metadata, so the directory is no checkpoint, and the previous one still loads."""
    (rank0, out0), (rank1, out1) = finish_ranks(start_ranks("kill", tmp_path), timeout=150)
    assert rank1 == -signal.SIGKILL, out1
    assert rank0 == 3, out0  # its save failed: its peer was gone
    bad = tmp_path / "bad"
    names = sorted(p.name for p in bad.iterdir())
    assert ".metadata" not in names
    assert any(n.startswith(".rank-00001.safetensors.ckptstream-tmp-") for n in names), names  # died mid-write
    big = reference(tmp_path)["big"]
    loaded = load_1({"big": poisoned_like(big)}, tmp_path / "good")
    assert same_bits(loaded["big"], big)
    raises_metadata_error(FileNotFoundError, r"no \.metadata: not a complete DCP checkpoint", load_1,
                          {"big": big.clone()}, bad)
    # the next save into the directory (one rank now) clears what the killed save left
    save_1({"big": big}, bad)
    assert sorted(p.name for p in bad.iterdir()) == [".metadata", "rank-00000.safetensors"]
    assert same_bits(load_1({"big": poisoned_like(big)}, bad)["big"], big)


@pytest.mark.slow
def test_host_memory_stays_bounded_cpu(tmp_path: Path) -> None:
    """dcp_worker.scenario_memory with CPU tensors: ~320 MiB per rank saved and loaded; each
    rank's RSS grows by at most the staging buffers + 64 MiB (test_dcp_gpu runs it on GPUs)."""
    run_ranks("memory", tmp_path, timeout=300)
