"""What ``ckptstream inspect`` and ``ckptstream verify`` print: the non-tensor values, keys by
their key paths (aliases and views with what they are stored as), the structure only where it
adds to the list; text from the file escaped (control characters, lone surrogates) in the table
and in strict JSON; ``verify`` of several files with the worst exit status; a closed pipe ends
quietly; corruption named by user-facing keys."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import CorruptCheckpointError, cli
from tests.helpers import craft_checkpoint


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def strict_json(text: str) -> Any:
    """JSON as other tools read it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def training_state() -> dict[str, Any]:
    w, v = torch.randn(6, 4), torch.randn(5, 3)
    return {
        "model": {"wte": w, "lm_head": w, "bias": torch.randn(4)},  # lm_head tied to wte
        "views": {"rows": v[:2], "col": v[:, 1]},  # views of v's memory: stored in one blob
        "optim": {"state": {0: {"exp_avg": torch.randn(6, 4)}},
                  "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.999), "params": [0]}]},
        "step": 1200, "epoch": 3, "finished": False, "best": None, "run": "gpt-small",
    }  # fmt: skip


# --- inspect --------------------------------------------------------------------------------


def test_inspect_shows_values_and_keys_by_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(training_state(), path, metadata={"git": "abc123"})
    status, out, err = run_cli(capsys, "inspect", str(path))
    assert status == 0
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"{path}: ckptstream 1, 6 tensors")
    tensor_lines = {line.split()[0]: line for line in lines[1:7]}
    assert list(tensor_lines) == ["model.wte", "model.lm_head", "model.bias", "views.rows", "views.col",
                                  "optim.state.0.exp_avg"]
    assert "(stored as" not in tensor_lines["model.wte"]
    assert tensor_lines["model.lm_head"].endswith("(stored as model.wte)")
    assert "F32      [6, 4]" in tensor_lines["model.lm_head"]
    for key in ("views.rows", "views.col"):
        assert tensor_lines[key].endswith("(stored as views.rows.__storage__)")
    assert "[2, 3]" in tensor_lines["views.rows"]
    assert "[5]" in tensor_lines["views.col"]
    values = lines[lines.index("values:") + 1 : lines.index("metadata:")]
    assert values == ["  optim.param_groups.0.lr: 0.0003", "  optim.param_groups.0.betas.0: 0.9",
                      "  optim.param_groups.0.betas.1: 0.999", "  optim.param_groups.0.params.0: 0",
                      "  step: 1200", "  epoch: 3", "  finished: False", "  best: None", "  run: 'gpt-small'"]
    assert lines[lines.index("metadata:") + 1] == "  git: abc123"
    structure = lines[lines.index("structure:") + 1 :]
    assert structure == ["  model: 3 tensors, 208 B", "  views: 2 tensors, 44 B", "  optim: 1 tensors, 96 B"]

    status, out, _ = run_cli(capsys, "inspect", "--json", str(path))
    report = strict_json(out)
    assert report["values"]["step"] == 1200
    assert report["values"]["optim.param_groups.0.lr"] == 3e-4
    assert [t["key"] for t in report["tensors"]][:2] == ["model.wte", "model.lm_head"]
    assert report["tensors"][1]["stored_as"] == "model.wte"
    assert "stored_as" not in report["tensors"][0]


def test_inspect_of_a_flat_model_lists_each_tensor_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.safetensors"
    names = [f"layers.{i}.weight" for i in range(5)]
    ckptstream.save({n: torch.randn(3) for n in names}, path)
    status, out, _ = run_cli(capsys, "inspect", str(path))
    assert status == 0
    for name in names:
        assert out.count(name) == 1
    assert "structure:" not in out
    assert "values:" not in out
    assert len(out.splitlines()) == 1 + len(names)


def test_inspect_escapes_control_characters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ANSI escapes (ESC, the one-character CSI U+009B), BEL, DEL, CR from the file never reach
    the terminal raw: in the table they are shown as escapes, in --json as JSON escapes."""
    key, value = "w\x1b[31mred\x9b2J\r", "\x1b]0;title\x07 and \x7f"
    meta_key, meta_value = "note\x1b[2J", "v\x1b[5m\x85"
    path = tmp_path / "ansi.safetensors"
    ckptstream.save({"model": {key: torch.randn(2)}, "name": value}, path, metadata={meta_key: meta_value})
    status, out, _ = run_cli(capsys, "inspect", str(path))
    assert status == 0
    raw_controls = [c for c in out if (ord(c) < 32 and c != "\n") or 127 <= ord(c) < 160]
    assert raw_controls == []
    assert "model.w\\x1b[31mred\\x9b2J\\x0d" in out
    assert "name: '\\x1b]0;title\\x07 and \\x7f'" in out
    assert "note\\x1b[2J: v\\x1b[5m\\x85" in out

    status, out, _ = run_cli(capsys, "inspect", "--json", str(path))
    assert status == 0
    assert [c for c in out if (ord(c) < 32 and c != "\n") or ord(c) >= 127] == []
    report = strict_json(out)
    assert report["tensors"][0]["key"] == f"model.{key}"
    assert report["values"]["name"] == value
    assert report["metadata"] == {meta_key: meta_value}


def test_inspect_prints_lone_surrogates_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key, text = "caf\udce9\x1b[1m", "v\udcff"  # valid JSON ("\udce9"), not valid UTF-8 text
    path = craft_checkpoint(tmp_path / "s.safetensors", [("w", "F32", [2], bytes(range(8)))],
                 json.dumps({"dict": [[key, {"tensor": "w"}], ["label", text]]}), metadata={"m\udcff": text})
    status, out, err = run_cli(capsys, "inspect", str(path))
    assert (status, err) == (0, "")
    assert "caf\\udce9\\x1b[1m  F32" in out
    assert "label: 'v\\udcff'" in out
    assert "m\\udcff: v\\udcff" in out
    out.encode("utf-8")  # what a UTF-8 terminal can take
    status, out, err = run_cli(capsys, "inspect", "--json", str(path))
    assert (status, err) == (0, "")
    report = strict_json(out)
    assert report["tensors"][0]["key"] == key
    assert report["values"] == {"label": text}
    assert report["metadata"] == {"m\udcff": text}


def test_inspect_json_is_strict_json_for_non_finite_values(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nan.safetensors"
    ckptstream.save({"w": torch.randn(2), "loss": math.nan, "best": math.inf, "worst": -math.inf, "lr": 0.1}, path)
    status, out, _ = run_cli(capsys, "inspect", "--json", str(path))
    assert status == 0
    values = strict_json(out)["values"]
    assert values == {"loss": "nan", "best": "inf", "worst": "-inf", "lr": 0.1}
    status, out, _ = run_cli(capsys, "inspect", str(path))
    assert "loss: nan" in out
    assert "best: inf" in out


@pytest.mark.parametrize("args", [["--max-items", "0"], ["--json"]], ids=["table", "json"])
def test_inspect_into_a_closed_pipe_ends_quietly(args: list[str], tmp_path: Path) -> None:
    """``ckptstream inspect ... | head -1``: a real pipe whose reader leaves after one line,
    with far more output than the pipe holds."""
    path = tmp_path / "many.safetensors"
    ckptstream.save({f"block.{i}.weight": torch.randn(1) for i in range(6000)}, path)
    proc = subprocess.Popen([sys.executable, "-m", "ckptstream.cli", "inspect", *args, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""
    assert first.startswith(f"{path}: ckptstream 1".encode()) or first == b"{\n"


# --- verify ---------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    ok, plain, corrupt = tmp_path / "ok.st", tmp_path / "plain.st", tmp_path / "corrupt.st"
    ckptstream.save(training_state(), ok)
    ckptstream.save({"w": torch.randn(8)}, plain, checksum=False)
    ckptstream.save({"w": torch.randn(8)}, corrupt)
    raw = bytearray(corrupt.read_bytes())
    raw[-3] ^= 0x10
    corrupt.write_bytes(bytes(raw))
    return {"ok": ok, "plain": plain, "corrupt": corrupt, "missing": tmp_path / "missing.st"}


def test_verify_says_when_a_file_has_no_checksums(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "verify", str(files["ok"]), str(files["plain"]))
    assert status == 0
    assert out.splitlines() == [f"{files['ok']}: OK (6 tensors, checksums verified)",
                                f"{files['plain']}: OK (structure only: the file has no checksums)"]


@pytest.mark.parametrize(("names", "expected"), [
    (["ok"], 0), (["ok", "plain"], 0), (["ok", "corrupt"], 1), (["corrupt", "ok"], 1),
    (["ok", "missing"], 2), (["missing", "corrupt", "ok"], 2), (["corrupt", "missing"], 2),
])  # fmt: skip
def test_verify_of_several_files_exits_with_the_worst(names: list[str], expected: int, files: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "verify", *(str(files[n]) for n in names))
    assert status == expected
    for name in names:  # every file is checked, whatever came before
        if name in ("ok", "plain"):
            assert f"{files[name]}: OK" in out
        else:
            assert str(files[name]) in err
    if "corrupt" in names:
        assert "tensor 'w' fails its CRC-32C check" in err


# --- corruption named by user-facing keys ---------------------------------------------------


def test_corruption_in_shared_bytes_names_the_keys_not_the_blob(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "views.st"
    ckptstream.save(training_state(), path)
    with ckptstream.open(path) as reader:
        blob = reader.entry("views.rows")
        assert blob.stored_as == "views.rows.__storage__"
        where = blob.offset + 5
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x04
    path.write_bytes(bytes(raw))
    messages = []
    for call in (ckptstream.load, ckptstream.verify):
        with pytest.raises(CorruptCheckpointError) as e:
            call(path)
        messages.append(str(e.value))
    status, _, err = run_cli(capsys, "verify", str(path))
    assert status == 1
    messages.append(err)
    for message in messages:
        assert "['views.rows', 'views.col']" in message
        assert "CRC-32C" in message
        assert "__storage__" not in message


# --- numbers JSON cannot hold ---------------------------------------------------------------


@pytest.mark.parametrize("number", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_in_the_structure_are_corrupt(number: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """JSON has no inf or nan; ckptstream stores them as {"float": "inf"}. A literal that
    overflows to inf is as non-standard as the Infinity constant, and both are refused."""
    path = craft_checkpoint(tmp_path / "n.st", [("w", "F32", [2], bytes(range(8)))],
                 '{"dict":[["w",{"tensor":"w"}],["lr",' + number + "]]}")
    with pytest.raises(CorruptCheckpointError, match="structure metadata is not valid JSON"):
        ckptstream.load(path)
    status, out, err = run_cli(capsys, "inspect", str(path))
    assert (status, out) == (1, "")
    assert number in err


def test_non_finite_floats_stored_as_ckptstream_writes_them_load(tmp_path: Path) -> None:
    path = craft_checkpoint(tmp_path / "ok.st", [("w", "F32", [2], bytes(range(8)))],
                 '{"dict":[["w",{"tensor":"w"}],["a",{"float":"inf"}],["b",{"float":"-inf"}],["c",{"float":"nan"}],'
                 '["d",1e300],["e",-1e-320]]}')
    back = ckptstream.load(path)
    assert (back["a"], back["b"], back["d"], back["e"]) == (math.inf, -math.inf, 1e300, -1e-320)
    assert math.isnan(back["c"])


def test_inspect_of_a_lightning_file_keeps_its_columns_and_counts(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Long module paths wrap onto a line of their own, the columns stay at most 60 characters
    wide; a collapsed container says how many items and how many leaves it hides, in agreement."""
    from ckptstream.lightning import StreamCheckpointIO

    long_name = "model." + ".".join(f"encoder_block_{i}.residual_attention_sublayer" for i in range(5)) + ".weight"
    groups = {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
              "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
              "decoupled_weight_decay": True, "initial_lr": 0.1, "params": list(range(10))}  # 13 items
    ckpt = {"state_dict": {long_name: torch.randn(4, 2), "model.head.bias": torch.randn(3)}, "global_step": 5,
            "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(4, 2)}}, "param_groups": [groups]}]}
    path = tmp_path / "epoch=0-step=5.ckpt"
    StreamCheckpointIO().save_checkpoint(ckpt, path)
    status, out, _ = run_cli(capsys, "inspect", str(path))
    assert status == 0
    lines = out.splitlines()
    at = lines.index(f"  state_dict.{long_name}")  # the key whole, on its own line
    assert len(f"state_dict.{long_name}") > 200
    width = len("optimizer_states.0.state.0.exp_avg")  # the widest key within 60 characters sets the column
    assert lines[at + 1] == f"  {'':<{width}}  F32      {'[4, 2]':<20} 32 B"
    assert f"  {'optimizer_states.0.state.0.exp_avg':<{width}}  F32      {'[4, 2]':<20} 32 B" in lines
    assert f"  {'state_dict.model.head.bias':<{width}}  F32      {'[3]':<20} 12 B" in lines
    assert ("  ... 12 more values in 3 more items of optimizer_states.0.param_groups.0 (it holds 13 items, the "
            "first 10 shown; --max-items 0 shows all)") in lines
    shown = [line for line in lines if line.startswith("  optimizer_states.0.param_groups.0.")]
    assert len(shown) == 11  # 10 items, betas with its two values
