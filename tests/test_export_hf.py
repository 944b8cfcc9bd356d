"""export_hf / ``ckptstream export-hf`` from checkpoint files and CheckpointManager directories:
the folder transformers writes (shards, index, tied weights once), bit-equal reloads through
``from_pretrained``, casts as torch casts, the folder's life (an earlier export kept until the new
one is complete, other files left alone) and typed errors naming the source. DCP sources are in
tests/dcp/test_export_hf_dcp.py, the memory bound and kills in tests/reliability."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import ckptstream
from ckptstream import CorruptCheckpointError, ExportError, Settings
from ckptstream._manager.directory import step_dir, write_done
from ckptstream.cli import main
from tests.helpers import flip_last_byte
from tests.hfutil import assert_reloads, check_folder, logits, reload, tiny_config, tiny_gpt2, trained_state

SMALL: dict[str, Any] = {"buffer_size": 8192, "num_buffers": 3, "io_threads": 3}  # windows cut tensors and runs


@pytest.fixture(scope="module")
def gpt2() -> Any:
    return tiny_gpt2()


@pytest.fixture
def state_file(tmp_path: Path, gpt2: Any) -> Path:
    path = tmp_path / "state.safetensors"
    ckptstream.save(trained_state(gpt2), path)
    return path


def test_a_training_state_exports_as_save_pretrained_shards_it(tmp_path: Path, gpt2: Any, state_file: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(tiny_config().to_json_string())
    out = tmp_path / "hf"
    result = ckptstream.export_hf(state_file, out, prefix="model.", max_shard_size="40KB", config=config,
                                  settings=Settings(**SMALL))
    tensors = check_folder(out)
    assert len(result.files) == len(list(out.iterdir()))
    assert result.files[-1] == "model.safetensors.index.json"
    assert result.tied == {"lm_head.weight": "transformer.wte.weight"}
    want = {k: v for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}
    assert tensors.keys() == want.keys()
    assert all(torch.equal(tensors[k], v) for k, v in want.items())
    assert (out / "config.json").read_bytes() == config.read_bytes()
    assert_reloads(out, gpt2)
    # the very shards transformers' own save_pretrained cuts from the model
    gpt2.save_pretrained(tmp_path / "theirs", max_shard_size="40KB")
    theirs = json.loads((tmp_path / "theirs" / "model.safetensors.index.json").read_text())
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert len(set(ours["weight_map"].values())) >= 3
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]


def test_one_shard_is_model_safetensors(tmp_path: Path, gpt2: Any, state_file: Path) -> None:
    (tmp_path / "hf").mkdir()
    shutil.copy(tmp_path / "state.safetensors", tmp_path / "hf" / "model.safetensors.index.json")  # stale: removed
    (tmp_path / "hf" / "config.json").write_text(tiny_config().to_json_string())
    result = ckptstream.export_hf(state_file, tmp_path / "hf", prefix="model.")
    assert result.files == ["model.safetensors"]
    check_folder(tmp_path / "hf", shards=1)
    assert_reloads(tmp_path / "hf", gpt2)


def _casts() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(1001, 3),  # windows of 8 KiB cut it between rows
        "d": torch.randn(700, 3, dtype=torch.float64),
        "h": torch.randn(33, dtype=torch.float16),
        "b16": torch.randn(9, 5).to(torch.bfloat16),
        "fp8": torch.randn(40).to(torch.float8_e4m3fn),
        "i": torch.randint(-(2**40), 2**40, (17,)),
        "flags": torch.rand(19) > 0.5,
        "scalar": torch.tensor(2.75),
        "empty": torch.empty(0, 4),
        "c": torch.randn(5, dtype=torch.complex64),
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_a_cast_is_torchs_own_and_leaves_integers_alone(tmp_path: Path, dtype: str) -> None:
    state = _casts()
    ckptstream.save({"model": state, "other": torch.randn(3)}, tmp_path / "s.safetensors")
    ckptstream.export_hf(tmp_path / "s.safetensors", tmp_path / "hf", prefix="model.", dtype=dtype,
                         max_shard_size="3KB", settings=Settings(**SMALL))
    got = check_folder(tmp_path / "hf")
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    assert got.keys() == state.keys()
    for name, t in state.items():
        want = t.to(target) if t.dtype.is_floating_point else t
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_a_bf16_export_reloads_as_the_model_cast_to_bf16(tmp_path: Path, gpt2: Any, state_file: Path) -> None:
    ckptstream.export_hf(state_file, tmp_path / "hf", prefix="model.", dtype="bf16", max_shard_size="30KB")
    tiny_config().save_pretrained(tmp_path / "hf")
    loaded = reload(tmp_path / "hf", torch.bfloat16)
    cast = copy.deepcopy(gpt2).to(torch.bfloat16)  # the weights state_file holds
    assert loaded.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    assert torch.equal(logits(loaded), logits(cast))


def test_bad_arguments_raise_typed_errors_naming_the_source_and_write_nothing(tmp_path: Path, state_file: Path) -> None:
    out = tmp_path / "hf"
    with pytest.raises(ExportError, match=rf"{state_file}.*no tensor's name starts with the prefix 'modle\.'"):
        ckptstream.export_hf(state_file, out, prefix="modle.")
    with pytest.raises(ExportError, match="dtype 'int8'"):
        ckptstream.export_hf(state_file, out, prefix="model.", dtype="int8")
    with pytest.raises(ExportError, match="max_shard_size '5XB'"):
        ckptstream.export_hf(state_file, out, prefix="model.", max_shard_size="5XB")
    with pytest.raises(ExportError, match="no name left once the prefix"):
        ckptstream.export_hf(state_file, out, prefix="model.transformer.wte.weight")
    with pytest.raises(ExportError, match=r"starts with a dot.*\('model\.'\)"):
        ckptstream.export_hf(state_file, out, prefix="model")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ExportError, match=r"bad\.json: holds a JSON list"):
        ckptstream.export_hf(state_file, out, prefix="model.", config=tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        ckptstream.export_hf(tmp_path / "missing.safetensors", out)
    assert not out.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        ckptstream.export_hf(state_file, tmp_path / "file", prefix="model.")
    # the source itself in OUT, under a name the export replaces
    inside = tmp_path / "inside"
    inside.mkdir()
    shutil.copy(state_file, inside / "model.safetensors")
    with pytest.raises(ExportError, match="the source lies in OUT"):
        ckptstream.export_hf(inside / "model.safetensors", inside, prefix="model.")
    assert sorted(p.name for p in inside.iterdir()) == ["model.safetensors"]


def test_a_training_state_without_a_prefix_is_refused_naming_its_top_level(tmp_path: Path, gpt2: Any,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    state = {**trained_state(gpt2), "rng": torch.get_rng_state()}
    src = tmp_path / "state.safetensors"
    ckptstream.save(state, src)
    out = tmp_path / "hf"
    want = (rf"{re.escape(str(src))}: holds more than a model's flat state of tensors: its top-level entries are "
            r"'model', 'optim', 'step', 'rng', and 'model' is not a tensor.*prefix='model\.' \(--prefix model\.\)"
            r".*prefix='' \(--prefix ''\) to export every tensor")
    with pytest.raises(ExportError, match=want):
        ckptstream.export_hf(src, out)
    assert main(["export-hf", str(src), str(out), "--quiet"]) == 2
    assert re.search(want, capsys.readouterr().err)
    assert not out.exists()
    # a flat state: no prefix needed; the optimizer alone is refused too
    flat = tmp_path / "flat.safetensors"
    ckptstream.save(gpt2.state_dict(), flat)
    ckptstream.export_hf(flat, out)
    tiny_config().save_pretrained(out)
    assert_reloads(out, gpt2)
    ckptstream.save(state["optim"], tmp_path / "optim.safetensors")
    with pytest.raises(ExportError, match=r"entries are 'state', 'param_groups', and 'state' is not.*prefix='state\.'"):
        ckptstream.export_hf(tmp_path / "optim.safetensors", tmp_path / "hf2")


def test_an_empty_prefix_exports_every_tensor_on_purpose(tmp_path: Path, gpt2: Any) -> None:
    state = {**trained_state(gpt2), "rng": torch.get_rng_state()}
    src = tmp_path / "state.safetensors"
    ckptstream.save(state, src)
    with ckptstream.open(src) as reader:
        stored = {e.key: reader.read(e.key) for e in reader.entries()}
    assert main(["export-hf", str(src), str(tmp_path / "hf"), "--prefix", "", "--quiet"]) == 0
    result = ckptstream.export_hf(src, tmp_path / "hf2", prefix="", max_shard_size="50KB")
    for folder in ("hf", "hf2"):
        got = check_folder(tmp_path / folder)
        tied = {"model.lm_head.weight"}  # stored once, under model.transformer.wte.weight
        assert got.keys() == stored.keys() - tied
        assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), stored[k].reshape(-1).view(torch.uint8))
                   for k in got)
    assert result.tied == {"model.lm_head.weight": "model.transformer.wte.weight"}
    assert "optim.state.0.exp_avg" in got


def test_a_corrupt_source_fails_and_leaves_the_earlier_export(tmp_path: Path, gpt2: Any, state_file: Path) -> None:
    out = tmp_path / "hf"
    ckptstream.export_hf(state_file, out, prefix="model.", max_shard_size="40KB")
    tiny_config().save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    flip_last_byte(state_file, "model.transformer.h.1.mlp.c_proj.weight")
    with pytest.raises(CorruptCheckpointError, match=r"model\.transformer\.h\.1\.mlp\.c_proj\.weight.*CRC-32C"):
        ckptstream.export_hf(state_file, out, prefix="model.", max_shard_size="60KB", dtype="bf16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_reloads(out, gpt2)


def test_a_new_export_replaces_only_the_weights_of_the_earlier(tmp_path: Path, gpt2: Any, state_file: Path) -> None:
    out = tmp_path / "hf"
    ckptstream.export_hf(state_file, out, prefix="model.", max_shard_size="20KB")
    assert len(list(out.glob("model-*.safetensors"))) > 4
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00001-of-00099.safetensors").write_text("a stale shard")
    ckptstream.export_hf(state_file, out, prefix="model.")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]
    ckptstream.export_hf(state_file, out, prefix="model.", max_shard_size="60KB")
    assert "model.safetensors" not in {p.name for p in out.iterdir()}
    tiny_config().save_pretrained(out)
    check_folder(out)
    assert_reloads(out, gpt2)


def _flat_state_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model's flat state of 4 tensors of 4000 bytes each (two shards under "8KB")."""
    g = torch.Generator().manual_seed(21)
    state = {f"layer.{i}.weight": torch.randn(1000, generator=g) for i in range(4)}
    ckptstream.save(state, tmp_path / "flat.safetensors")
    return tmp_path / "flat.safetensors", state


OUTPUTS = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
           "model.safetensors.index.json"]


@pytest.mark.parametrize("dangling", [False, True])
@pytest.mark.parametrize("name", OUTPUTS)
def test_a_link_under_a_name_the_export_writes_is_refused(tmp_path: Path, name: str, dangling: bool) -> None:
    src, _ = _flat_state_file(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    outside = tmp_path / "outside"
    if not dangling:
        outside.write_bytes(os.urandom(1000))
    before = outside.read_bytes() if not dangling else None
    out = tmp_path / "hf"
    out.mkdir()
    (out / name).symlink_to(outside)
    with pytest.raises(ExportError, match=rf"{re.escape(str(out / name))}: is not a regular file \(a symbolic link"):
        ckptstream.export_hf(src, out, max_shard_size="1GB" if name == "model.safetensors" else "8KB",
                             config=tmp_path / "config.json")
    assert os.listdir(out) == [name]
    assert (out / name).is_symlink()
    assert (outside.read_bytes() if not dangling else None) == before
    assert dangling == (not outside.exists())
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", "flat.safetensors", "hf"]
                                                  + ([] if dangling else ["outside"]))  # no temp beside it


def test_a_link_under_a_name_the_export_removes_goes_and_its_target_stays(tmp_path: Path) -> None:
    src, state = _flat_state_file(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(os.urandom(1000))
    before = outside.read_bytes()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00099.safetensors").symlink_to(outside)  # an earlier export's stale shard
    ckptstream.export_hf(src, out)
    assert os.listdir(out) == ["model.safetensors"]
    assert outside.read_bytes() == before
    got = check_folder(out, shards=1)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_distinct_views_of_one_storage_are_each_exported_and_equal_views_tied(tmp_path: Path) -> None:
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(8))
    state = {"model": {"top": w[:4], "bottom": w[2:], "again": w[:4]}, "step": 1}  # overlapping: one blob, views
    ckptstream.save(state, tmp_path / "views.safetensors")
    with ckptstream.open(tmp_path / "views.safetensors") as reader:
        assert len({e.stored_as for e in reader.entries()}) == 1
        assert all(e.view is not None for e in reader.entries())
    result = ckptstream.export_hf(tmp_path / "views.safetensors", tmp_path / "hf", prefix="model.",
                                  settings=Settings(**SMALL))
    got = check_folder(tmp_path / "hf", shards=1)
    assert sorted(got) == ["bottom", "top"]
    assert got["top"].view(torch.int32).equal(w[:4].view(torch.int32))
    assert got["bottom"].view(torch.int32).equal(w[2:].view(torch.int32))
    assert result.tied == {"again": "top"}


def test_a_prefix_matches_the_start_of_a_name_only(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    model = {"w": torch.randn(7, 3, generator=g), "b": torch.randn(3, generator=g)}
    ema = {"model": {"w": torch.randn(7, 3, generator=g), "b": torch.randn(3, generator=g),
                     "extra": torch.randn(2, generator=g)}}
    ckptstream.save({"ema": ema, "model": model, "step": 1}, tmp_path / "s.safetensors")
    result = ckptstream.export_hf(tmp_path / "s.safetensors", tmp_path / "hf", prefix="model.")
    got = check_folder(tmp_path / "hf", shards=1)
    assert sorted(got) == ["b", "w"]
    assert all(got[k].view(torch.int32).equal(model[k].view(torch.int32)) for k in model)
    assert (result.tensors, result.total_size) == (2, 96)


def _rank_step(directory: Path, step: int, states: list[dict[str, Any]]) -> Path:
    folder = step_dir(str(directory), step)
    Path(folder).mkdir(parents=True)
    for rank, state in enumerate(states):
        ckptstream.save(state, Path(folder) / f"rank-{rank:05d}-of-{len(states):05d}.safetensors")
    write_done(str(directory), step, len(states))
    return Path(folder)


def test_a_manager_directory_exports_its_newest_complete_step(tmp_path: Path, gpt2: Any) -> None:
    with ckptstream.CheckpointManager(tmp_path / "ckpts", keep=None) as manager:
        manager.save({"model": {"w": torch.randn(4)}}, 1)
        manager.save(trained_state(gpt2), 2)
    (tmp_path / "ckpts" / "step-000000000003").mkdir()  # an unfinished save: no DONE
    result = ckptstream.export_hf(tmp_path / "ckpts", tmp_path / "hf", prefix="model.")
    assert "step 2" in result.source
    tiny_config().save_pretrained(tmp_path / "hf")
    assert_reloads(tmp_path / "hf", gpt2)
    with pytest.raises(ExportError, match="not a complete step"):
        ckptstream.export_hf(tmp_path / "ckpts" / "step-000000000003", tmp_path / "hf2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="empty: holds no complete checkpoint"):
        ckptstream.export_hf(tmp_path / "empty", tmp_path / "hf2")


def test_ranks_holding_replicas_or_their_own_layers_export_once(tmp_path: Path, gpt2: Any) -> None:
    model = {k: v.clone() for k, v in gpt2.state_dict().items()}
    step = _rank_step(tmp_path / "replicas", 5, [{"model": model, "rank": 0}, {"model": model, "rank": 1}])
    result = ckptstream.export_hf(step, tmp_path / "hf", prefix="model.")
    assert "2 ranks" in result.source
    tiny_config().save_pretrained(tmp_path / "hf")
    assert_reloads(tmp_path / "hf", gpt2)
    names = list(model)
    halves = [{k: model[k] for k in names[: len(names) // 2]}, {k: model[k] for k in names[len(names) // 2 :]}]
    _rank_step(tmp_path / "stages", 7, [{"model": halves[0]}, {"model": halves[1]}])
    ckptstream.export_hf(tmp_path / "stages", tmp_path / "hf2", prefix="model.")
    assert check_folder(tmp_path / "hf2").keys() == set(names)


def test_ranks_holding_different_values_under_one_name_are_refused(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    step = _rank_step(tmp_path / "shards", 3, [{"model": {"w": w[:4]}}, {"model": {"w": w[4:] + 1}}])
    with pytest.raises(ExportError, match=r"different tensors under 'model\.w'.*rank-00001-of-00002.*StreamWriter"):
        ckptstream.export_hf(step, tmp_path / "hf", prefix="model.")
    assert not (tmp_path / "hf").exists()


def test_the_command(tmp_path: Path, gpt2: Any, state_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_config().save_pretrained(tmp_path / "cfg")
    code = main(["export-hf", str(state_file), str(tmp_path / "hf"), "--prefix", "model.", "--max-shard-size", "40KB",
                 "--config", str(tmp_path / "cfg" / "config.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "lm_head.weight: tied to transformer.wte.weight" in out
    assert "model.safetensors.index.json" in out
    assert_reloads(tmp_path / "hf", gpt2)
    assert main(["export-hf", str(state_file), str(tmp_path / "hf2"), "--prefix", "x.", "--quiet"]) == 2
    assert f"{state_file}: no tensor's name starts with the prefix 'x.'" in capsys.readouterr().err
    flip_last_byte(state_file, "model.transformer.wte.weight")
    assert main(["export-hf", str(state_file), str(tmp_path / "hf3"), "--prefix", "model.", "--quiet"]) == 1
    assert "fails its CRC-32C check" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export-hf", str(state_file), str(tmp_path / "hf4"), "--dtype", "int8"])


def test_the_benchmark_measures_an_export_against_a_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "export.json"
    assert main(["bench", "--export", "--quick", "--repeat", "2", "--dir", str(tmp_path), "--json", str(report)]) == 0
    assert "time ratio" in capsys.readouterr().out
    rows = json.loads(report.read_text())["export"]["rows"]
    assert set(rows) == {"export", "export --dtype bf16 (fp32 master)"}
    assert all(len(r["ratio"]) == 2 and r["ratio_median"] > 0 for r in rows.values())
    assert [p.name for p in tmp_path.iterdir()] == ["export.json"]  # its workspace removed


def test_shards_are_cut_as_huggingface_hub_cuts_them() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    from ckptstream._export.plan import OutTensor, split

    rng = torch.Generator().manual_seed(3)
    for limit in (100, 128, 1000):
        sizes = [int(n) for n in torch.randint(1, 160, (60,), generator=rng)] + [limit, limit, 1, limit - 1, 2 * limit]
        names = [f"t{i:03d}" for i in range(len(sizes))]
        state = {name: torch.empty(n, dtype=torch.uint8) for name, n in zip(names, sizes, strict=True)}
        theirs = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        ours = split([OutTensor(name, name, torch.uint8, (n,), [], torch.uint8)
                      for name, n in zip(names, sizes, strict=True)], limit)
        assert [[t.name for t in shard] for shard in ours] == list(theirs.filename_to_tensors.values())


def test_shard_sizes_are_read_as_huggingface_hub_reads_them() -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    from ckptstream._export.plan import parse_size

    for size in ("5GB", "500MB", "40KB", "1.5GB", "3TB", " 7 MB", "2kb", "0.25GB"):
        assert parse_size(size) == parse_size_to_int(size), size  # powers of 10
    binary = {"5GiB": 5 * 2**30, "2MiB": 2 * 2**20, "40KiB": 40 * 2**10, "1TiB": 2**40, "3gib": 3 * 2**30}
    assert {size: parse_size(size) for size in binary} == binary
    assert parse_size(12345) == 12345


def test_an_export_through_another_storage_replaces_the_earlier_one(tmp_path: Path, mem: Any) -> None:
    """The export uses the storage seam only: into an in-memory storage, sealing does nothing,
    and publishing names each object."""
    src, state = _flat_state_file(tmp_path)
    first = ckptstream.export_hf(src, "mem://space/hf", max_shard_size="8KB")
    assert first.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json"]
    ckptstream.export_hf(src, "mem://space/hf", max_shard_size="8KB")  # over shards of the same names
    assert sorted(mem.objects) == sorted(f"mem://space/hf/{name}" for name in first.files)
    ckptstream.export_hf(src, "mem://space/hf")
    assert sorted(mem.objects) == ["mem://space/hf/model.safetensors"]
    assert not mem.pending
    with ckptstream.open("mem://space/hf/model.safetensors") as reader:
        assert reader.keys() == list(state)
        assert all(reader.read(k).view(torch.int32).equal(v.view(torch.int32)) for k, v in state.items())
