"""export_hf from DCP checkpoints: DTensors saved by two gloo ranks (sharded on dimension 0, or
on dimension 1 so that every row interleaves the ranks' chunks) through StreamWriter and
through DCP's FileSystemWriter, put back together and reloaded bit-equal by ``from_pretrained``;
FileSystemWriter checkpoints whose metadata or chunks could only be read by running code are
refused; on the GPU machine, a checkpoint of CUDA DTensors."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptstream
import ckptstream.dcp
from ckptstream import ExportError, Settings
from tests.dcp.dcp_helpers import HERE, finish_ranks, single_process, worker_env
from tests.hfutil import assert_reloads, check_folder, tiny_config, tiny_gpt2

TESTS = HERE.parent


def run_job(scenario: str, workdir: Path, world: int = 2, backend: str = "gloo") -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / f"store-{scenario}-{time.monotonic_ns()}"
    env = worker_env()

    procs = [subprocess.Popen([sys.executable, str(HERE / "hf_worker.py"), scenario, str(rank), str(world),
                               str(workdir), str(store), backend], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    results = finish_ranks(procs, 240)
    assert all(code == 0 for code, _ in results), "\n".join(out[-4000:] for _, out in results)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("dcp-hf")
    run_job("shard0", workdir)
    run_job("shard1", workdir)
    return workdir


def _export_and_reload(src: Path, out: Path, **options: Any) -> dict[str, torch.Tensor]:
    result = ckptstream.export_hf(src, out, max_shard_size="40KB",
                                  **options, settings=Settings(buffer_size=8192, num_buffers=3, io_threads=3))
    assert result.tied == {}  # DCP records no sharing: both names are written, and from_pretrained ties them
    tiny_config().save_pretrained(out)
    tensors = check_folder(out)
    assert_reloads(out, tiny_gpt2())
    return tensors


@pytest.mark.parametrize("scenario", ["shard0", "shard1", "fsw"])
def test_dtensors_of_two_ranks_export_and_reload_bit_equal(saved: Path, tmp_path: Path, scenario: str) -> None:
    tensors = _export_and_reload(saved / scenario, tmp_path / "hf")
    want = tiny_gpt2().state_dict()
    assert tensors.keys() == want.keys()
    assert all(torch.equal(tensors[k], v) for k, v in want.items())


def test_a_dim_1_shard_interleaves_its_rows(saved: Path) -> None:
    with ckptstream.open(saved / "shard1" / "rank-00001.safetensors") as reader:
        assert reader.entry("transformer.h.0.mlp.c_fc.weight").shape == (64, 128)  # half of (64, 256)
    metadata = ckptstream.dcp.StreamReader(saved / "shard1").read_metadata()
    tensor = metadata.state_dict_metadata["transformer.h.0.mlp.c_fc.weight"]
    assert isinstance(tensor, TensorStorageMetadata)
    chunks = tensor.chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (0, 128)]


def test_a_bf16_export_of_dim_1_shards_is_torchs_cast(saved: Path, tmp_path: Path) -> None:
    ckptstream.export_hf(saved / "shard1", tmp_path / "hf", dtype="bf16", settings=Settings(buffer_size=4096,
                                                                                            num_buffers=2))
    got = check_folder(tmp_path / "hf")
    for name, t in tiny_gpt2().state_dict().items():
        assert torch.equal(got[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name


def test_a_damaged_chunk_fails_its_checksum(saved: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved / "shard1", copy)
    with ckptstream.open(copy / "rank-00000.safetensors") as reader:
        entry = reader.entry("transformer.h.1.attn.c_proj.weight")
    with open(copy / "rank-00000.safetensors", "r+b") as f:
        f.seek(entry.offset + 777)
        byte = f.read(1)
        f.seek(entry.offset + 777)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"c_proj\.weight.*fails its CRC-32C check"):
        ckptstream.export_hf(copy, tmp_path / "hf", settings=Settings(buffer_size=4096))
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


def _fsw_save(state: dict[str, Any], path: Path) -> None:
    single_process(dcp.save, state, storage_writer=dcp.FileSystemWriter(path))


def test_a_filesystemwriter_checkpoint_of_plain_tensors_exports(tmp_path: Path) -> None:
    model = tiny_gpt2()
    _fsw_save({"model": model.state_dict(), "step": 3}, tmp_path / "fsw")
    ckptstream.export_hf(tmp_path / "fsw", tmp_path / "hf", prefix="model.")
    tiny_config().save_pretrained(tmp_path / "hf")
    assert_reloads(tmp_path / "hf", model)


def test_a_filesystemwriter_chunk_that_needs_unpickling_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.save

    def as_parameter(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:  # pickled through _rebuild_parameter
        real(torch.nn.Parameter(obj) if isinstance(obj, torch.Tensor) else obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", as_parameter)
    _fsw_save({"model": {"w": torch.randn(3, 4)}}, tmp_path / "fsw")
    monkeypatch.undo()
    with pytest.raises(ExportError, match=r"fsw: the chunk of 'model\.w'.*_rebuild_parameter.*running code"):
        ckptstream.export_hf(tmp_path / "fsw", tmp_path / "hf", prefix="model.")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("writer", ["fsw", "stream"])
def test_a_training_state_without_a_prefix_is_refused(tmp_path: Path, writer: str) -> None:
    g = torch.Generator().manual_seed(4)
    w, rng = torch.randn(3, 4, generator=g), torch.get_rng_state()
    state = {"model": {"w": w}, "optim": {"state": {"w": {"exp_avg": torch.randn(3, 4, generator=g)}}}, "rng": rng,
             "step": 3}
    src = tmp_path / writer
    make = dcp.FileSystemWriter(src) if writer == "fsw" else ckptstream.dcp.StreamWriter(src)
    single_process(dcp.save, state, storage_writer=make)
    with pytest.raises(ExportError, match=rf"{writer}: holds more than a model's flat state of tensors: its top-level "
                                          r"entries are 'model', 'optim', 'rng', 'step'.*prefix='model\.'"):
        ckptstream.export_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    ckptstream.export_hf(src, tmp_path / "hf", prefix="")
    got = check_folder(tmp_path / "hf")
    assert sorted(got) == ["model.w", "optim.state.w.exp_avg", "rng"]
    assert torch.equal(got["model.w"], w)
    assert torch.equal(got["rng"], rng)


def test_a_filesystemwriter_chunk_whose_tensor_runs_past_its_storage_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FileSystemWriter chunks hold no checksum: bytes read past the storage's entry (the zip's
    next header) would be exported as the tensor's, without a word."""
    real = torch.save

    def shifted(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:  # storage offset 0 -> 4 elements
        if not isinstance(obj, torch.Tensor):
            return real(obj, f, *args, **kwargs)
        raw = io.BytesIO()
        real(obj, raw, *args, **kwargs)
        archive, out = zipfile.ZipFile(io.BytesIO(raw.getvalue())), io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
            for info in archive.infolist():
                data = archive.read(info)
                if info.filename.endswith("/data.pkl"):
                    assert data.count(b"QK\x00") == 1  # BINPERSID (the storage), then BININT1 0 (its offset)
                    data = data.replace(b"QK\x00", b"QK\x04")
                rewritten.writestr(info.filename, data)
        f.write(out.getvalue())
        return None

    monkeypatch.setattr(torch, "save", shifted)
    _fsw_save({"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(2))}, tmp_path / "fsw")
    monkeypatch.undo()
    with pytest.raises(ExportError, match=r"fsw: the chunk of 'w'.*its tensor runs past its storage's 48 bytes"):
        ckptstream.export_hf(tmp_path / "fsw", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


class Opaque:
    """A class of the test's own: what a custom planner may store in DCP's metadata."""


def test_filesystemwriter_metadata_that_needs_unpickling_is_refused(tmp_path: Path) -> None:
    _fsw_save({"model": {"w": torch.randn(3, 4)}}, tmp_path / "fsw")
    metadata_path = tmp_path / "fsw" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    metadata.planner_data = {"model.w": Opaque()}
    metadata_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ExportError, match=r"fsw: its \.metadata holds .*Opaque.*cannot be read without running code"):
        ckptstream.export_hf(tmp_path / "fsw", tmp_path / "hf")


@pytest.mark.gpu
def test_cuda_dtensors_export_and_reload_bit_exact(tmp_path: Path) -> None:
    run_job("cuda", tmp_path, world=1, backend="nccl")
    tensors = _export_and_reload(tmp_path / "cuda", tmp_path / "hf")
    want = tiny_gpt2().state_dict()
    assert all(torch.equal(tensors[k], v) for k, v in want.items())


def test_chunks_that_overlap_are_refused(saved: Path, tmp_path: Path) -> None:
    import dataclasses
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    copy = tmp_path / "copy"
    shutil.copytree(saved / "shard0", copy)
    metadata = pickle.loads((copy / ".metadata").read_bytes())
    fqn = "transformer.h.0.mlp.c_fc.weight"
    chunks = metadata.state_dict_metadata[fqn].chunks
    moved = chunks[1]
    chunks[1] = dataclasses.replace(moved, offsets=torch.Size([16, 0]))  # rows 16..31 twice, 48..63 in none
    record = metadata.storage_data.pop(MetadataIndex(fqn, moved.offsets))
    metadata.storage_data[MetadataIndex(fqn, [16, 0])] = record
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"two chunks hold element 4096 of 'transformer"):
        ckptstream.export_hf(copy, tmp_path / "hf", settings=Settings(buffer_size=4096))


def test_a_chunk_past_the_tensors_edge_is_refused_naming_it(tmp_path: Path) -> None:
    """Its element count is the tensor's: only the check of its place finds it before the bytes move."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex

    _fsw_save({"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(6))}, tmp_path / "fsw")
    metadata = pickle.loads((tmp_path / "fsw" / ".metadata").read_bytes())
    chunks = metadata.state_dict_metadata["w"].chunks
    assert [list(c.offsets) for c in chunks] == [[0, 0]]
    chunks[0] = dataclasses.replace(chunks[0], offsets=torch.Size([2, 0]))  # rows 2..9 of 8
    metadata.storage_data[MetadataIndex("w", [2, 0])] = metadata.storage_data.pop(MetadataIndex("w", [0, 0]))
    (tmp_path / "fsw" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ckptstream.CorruptCheckpointError,
                       match=r"the chunk of 'w' at \[2, 0\].*a box of \[8, 4\] at \[2, 0\] does not fit the "
                             r"tensor's shape \[8, 4\]; the metadata is damaged"):
        ckptstream.export_hf(tmp_path / "fsw", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
