"""``ckptstream verify`` and ``inspect`` of folders of checkpoint files: a Hugging Face export
(its index checked against its shards, then each shard), a folder of Lightning ``.ckpt`` files
written by StreamCheckpointIO (file by file, the worst status). (An object's URL:
tests/s3/test_s3_cli.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli

INDEX = "model.safetensors.index.json"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """An export of three shards: a, then b and c, then d."""
    state = {"model": {"a": torch.randn(200, 200), "b": torch.randn(200, 200), "c": torch.randn(100, 100),
                       "d": torch.randn(50)}, "step": 4}
    ckptstream.save(state, tmp_path / "src.safetensors")
    result = ckptstream.export_hf(tmp_path / "src.safetensors", tmp_path / "hf", prefix="model.",
                                  max_shard_size="200KB")
    assert sorted(result.files) == sorted([*SHARDS, INDEX])
    return tmp_path / "hf"


def weight_map(folder: Path) -> dict[str, str]:
    mapping: dict[str, str] = json.loads((folder / INDEX).read_text())["weight_map"]
    return mapping


def rewrite_index(folder: Path, change: Any) -> None:
    index = json.loads((folder / INDEX).read_text())
    change(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def test_verify_and_inspect_a_hugging_face_export(hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert weight_map(hf_dir) == {"a": SHARDS[0], "b": SHARDS[1], "c": SHARDS[1], "d": SHARDS[2]}
    status, out, err = run_cli(capsys, "verify", str(hf_dir))
    assert (status, err) == (0, "")
    tensors = {name: len(ckptstream.open(hf_dir / name).keys()) for name in SHARDS}
    assert out.splitlines() == [
        f"{hf_dir / INDEX}: OK (Hugging Face index: 3 shards, 4 tensors, each in the shard it names)",
        *[f"{hf_dir / name}: OK ({tensors[name]} tensors, checksums verified)" for name in SHARDS]]
    status, out, err = run_cli(capsys, "inspect", str(hf_dir))
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{hf_dir}: folder of checkpoint files, a Hugging Face export ({INDEX}), 3 file(s)"
    for name in SHARDS:
        assert f"{hf_dir / name}: safetensors, {tensors[name]} tensors" in out


def _missing_shard(folder: Path) -> str:
    (folder / SHARDS[1]).unlink()
    return f"{folder / INDEX} maps 2 tensor(s) (such as 'b') to '{SHARDS[1]}', which is not a file of {folder}"


def _key_in_another_shard(folder: Path) -> str:
    def move(m: dict[str, str]) -> None:
        m["a"], m["b"] = m["b"], m["a"]

    rewrite_index(folder, move)
    return f"{folder / INDEX} maps 'b' to {SHARDS[0]}, which does not hold it"


def _key_not_in_the_index(folder: Path) -> str:
    rewrite_index(folder, lambda m: m.pop("d"))
    return f"{SHARDS[2]} holds 'd', which {INDEX} does not map to it"


def _shard_of_another_export(folder: Path) -> str:
    shutil.copyfile(folder / SHARDS[0], folder / SHARDS[1])  # each shard sound on its own
    return f"{folder / INDEX} maps 'b' to {SHARDS[1]}, which does not hold it"


def _not_json(folder: Path) -> str:
    (folder / INDEX).write_bytes((folder / INDEX).read_bytes()[:-20])
    return f"{folder / INDEX} is not JSON ("


def _path_out_of_the_folder(folder: Path) -> str:
    rewrite_index(folder, lambda m: m.update(a=f"../{SHARDS[0]}"))
    return f"{folder / INDEX} maps 'a' to '../{SHARDS[0]}', which is not a file name in its folder"


DAMAGES = {f.__name__.lstrip("_"): f for f in (_missing_shard, _key_in_another_shard, _key_not_in_the_index,
                                              _shard_of_another_export, _not_json, _path_out_of_the_folder)}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_an_index_that_does_not_match_its_shards_fails(damage: str, hf_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    expected = DAMAGES[damage](hf_dir)
    status, out, err = run_cli(capsys, "verify", str(hf_dir))
    assert status == 1
    assert f"ckptstream verify: {expected}" in err, err
    assert out.count(": OK (") == len(list(hf_dir.glob("*.safetensors")))  # each shard still verified on its own


def test_a_corrupt_shard_fails_the_export(hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = bytearray((hf_dir / SHARDS[2]).read_bytes())
    raw[-5] ^= 0x04
    (hf_dir / SHARDS[2]).write_bytes(bytes(raw))
    status, out, err = run_cli(capsys, "verify", str(hf_dir))
    assert status == 1
    assert f"{hf_dir / SHARDS[2]}: tensor 'd'" in err  # the last tensor of that shard
    assert out.count(": OK (") == 3  # the index and the other two shards


def test_a_folder_of_lightning_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptstream.lightning import StreamCheckpointIO

    folder = tmp_path / "checkpoints"
    io = StreamCheckpointIO()
    for step in (10, 20):
        io.save_checkpoint({"state_dict": {"net.0.weight": torch.randn(8, 4)}, "global_step": step, "epoch": 0,
                            "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(8, 4)}}}]},
                           folder / f"epoch=0-step={step}.ckpt")
    (folder / "hparams.yaml").write_text("lr: 0.1\n")
    names = ["epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"]
    status, out, err = run_cli(capsys, "verify", str(folder))
    assert (status, err) == (0, "")
    assert out.splitlines() == [f"{folder / n}: OK (2 tensors, checksums verified)" for n in names]
    status, out, _ = run_cli(capsys, "inspect", str(folder))
    assert status == 0
    assert out.splitlines()[0] == f"{folder}: folder of checkpoint files, 2 file(s)"
    assert out.count("state_dict.net.0.weight") == 2
    raw = bytearray((folder / names[0]).read_bytes())
    raw[-1] ^= 0x01
    (folder / names[0]).write_bytes(bytes(raw))
    status, out, err = run_cli(capsys, "verify", str(folder))
    assert status == 1
    assert out == f"{folder / names[1]}: OK (2 tensors, checksums verified)\n"
    assert f"{folder / names[0]}: tensor " in err
    torch.save({"w": torch.randn(3)}, folder / "last.ckpt")  # Lightning's default format among them
    status, _, err = run_cli(capsys, "verify", str(folder))
    assert status == 2
    assert f"{folder / 'last.ckpt'} is a torch.save file" in err
