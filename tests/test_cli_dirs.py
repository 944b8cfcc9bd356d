"""``ckptstream verify`` and ``inspect`` of whole checkpoints: a CheckpointManager directory
(every step, or ``--step N``), one step folder, a DCP checkpoint's folder (ckptstream's rank
files on two ranks, and torch's FileSystemWriter's files), and what is not one of those: a
DCP ``.metadata`` given as a file, hostile and damaged markers and metadata. Also: long
containers collapsed by ``--max-items``, a damaged header located, and the benchmark's and
DCP's modules imported only where needed."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli
from ckptstream._manager import directory as _directory
from tests.helpers import child_env

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


# --- a CheckpointManager directory ---------------------------------------------------------------


def step_state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(16, 4), "b": torch.randn(3), "step": step}


@pytest.fixture
def manager_dir(tmp_path: Path) -> Path:
    """Steps 1 and 2 complete (one process), step 3 complete with two ranks' files, step 4 left
    without DONE."""
    directory = tmp_path / "ckpts"
    with ckptstream.CheckpointManager(directory, keep=5) as manager:
        for step in (1, 2):
            manager.save(step_state(step), step).result()
    folder = Path(_directory.step_dir(str(directory), 3))
    folder.mkdir()
    for rank in range(2):
        ckptstream.save(step_state(30 + rank), folder / _directory.file_name(rank, 2))
    _directory.write_done(str(directory), 3, 2)
    leftover = Path(_directory.step_dir(str(directory), 4))
    leftover.mkdir()
    ckptstream.save(step_state(4), leftover / "state.safetensors")
    return directory


def test_verify_a_manager_directory_checks_every_step(manager_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "verify", str(manager_dir))
    assert (status, err) == (0, "")
    folders = {s: _directory.step_dir(str(manager_dir), s) for s in (1, 2, 3, 4)}
    assert out.splitlines() == [
        f"{folders[1]}: OK (step 1: 1 file, 2 tensors, checksums verified)",
        f"{folders[2]}: OK (step 2: 1 file, 2 tensors, checksums verified)",
        f"{folders[3]}: OK (step 3: 2 files, 4 tensors, checksums verified)",
        f"{folders[4]}: incomplete, ignored by the manager: no DONE marker (its save did not finish, or is still "
        "running)",
    ]


def test_step_and_folder_arguments(manager_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder3 = _directory.step_dir(str(manager_dir), 3)
    assert run_cli(capsys, "verify", str(manager_dir), "--step", "3")[:2] == (
        0, f"{folder3}: OK (step 3: 2 files, 4 tensors, checksums verified)\n")
    assert run_cli(capsys, "verify", folder3)[0] == 0
    status, out, err = run_cli(capsys, "verify", str(manager_dir), "--step", "4")  # asked for: incomplete is a failure
    assert (status, out) == (1, "")
    assert "step-000000000004: INCOMPLETE: no DONE marker" in err
    status, _, err = run_cli(capsys, "verify", str(manager_dir), "--step", "9")
    assert status == 2
    assert f"{manager_dir}: no step 9 (its step folders: 1, 2, 3, 4)" in err
    status, _, err = run_cli(capsys, "inspect", str(manager_dir), "--step", "9")
    assert status == 2
    assert f"ckptstream inspect: {manager_dir}: no step 9" in err
    status, _, err = run_cli(capsys, "verify", folder3, "--step", "3")
    assert status == 2
    assert "--step picks a step of a CheckpointManager directory; this is a CheckpointManager step folder" in err


def test_a_corrupt_rank_file_fails_its_step_and_the_directory(manager_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rank1 = Path(_directory.step_dir(str(manager_dir), 3)) / _directory.file_name(1, 2)
    raw = bytearray(rank1.read_bytes())
    raw[-2] ^= 0x08
    rank1.write_bytes(bytes(raw))
    status, out, err = run_cli(capsys, "verify", str(manager_dir))
    assert status == 1
    assert out.count(": OK (") == 2  # the other steps are still checked and sound
    assert f"step 3: {rank1}: tensor 'w' fails its CRC-32C check" in err  # the last tensor of the file


def test_a_directory_without_a_complete_step_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = Path(_directory.step_dir(str(tmp_path), 5))
    folder.mkdir()
    (folder / "FAILED-rank-00001").write_text("OSError: disk full\n")
    status, out, err = run_cli(capsys, "verify", str(tmp_path))
    assert status == 1
    assert "incomplete, ignored by the manager: no DONE marker (its save did not finish, or is still running); " \
        "rank 1 failed: OSError: disk full" in out
    assert f"{tmp_path}: INCOMPLETE: no complete step among its 1 step folders" in err


def write_done(folder: Path, done: Any) -> None:
    (folder / "DONE").write_text(json.dumps(done))


@pytest.mark.parametrize("damage", ["fifo", "huge", "deep", "outside", "size", "missing", "format", "not_json"])
def test_a_damaged_or_hostile_done_is_an_incomplete_step_with_its_reason(damage: str, manager_dir: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A DONE marker that is a FIFO (never waited on), too large, nested too deep, naming a file
    outside the folder (even one that exists with that size), or not matching the files: the
    step is incomplete, said with the reason; verify of that step exits 1, the directory 0."""
    folder = Path(_directory.step_dir(str(manager_dir), 2))
    done_path = folder / "DONE"
    good = json.loads(done_path.read_text())
    done_path.unlink()
    outside = manager_dir.parent / "secret.txt"
    outside.write_text("not a checkpoint")
    if damage == "fifo":
        os.mkfifo(done_path)
    elif damage == "huge":
        done_path.write_bytes(b" " * (2 << 20))
    elif damage == "deep":  # within the size bound, past json's recursion limit
        done_path.write_text("[" * 4000 + "]" * 4000)
    elif damage == "outside":
        write_done(folder, dict(good, files={"../../secret.txt": outside.stat().st_size}))
    elif damage == "size":
        write_done(folder, dict(good, files={"state.safetensors": good["files"]["state.safetensors"] + 1}))
    elif damage == "missing":
        write_done(folder, good)
        (folder / "state.safetensors").unlink()
    elif damage == "format":
        write_done(folder, dict(good, format="something else"))
    else:
        done_path.write_bytes(b"\xff\xfe{")
    reason = {
        "fifo": "DONE is not a regular file (a symbolic link, a FIFO",
        "huge": f"DONE holds {2 << 20} bytes, more than the 8192 expected of it",
        "deep": "DONE is malformed: it holds 4000 brackets, a DONE marker at most 16 (not parsed)",
        "outside": "DONE names '../../secret.txt': a path, not a plain file name of the step folder",
        "size": f"size mismatch of state.safetensors: DONE records {good['files']['state.safetensors'] + 1} bytes, "
                f"the file has {good['files']['state.safetensors']}",
        "missing": "state.safetensors is missing",
        "format": "DONE is malformed: not a 'ckptstream-manager 1' record",
        "not_json": "DONE is malformed: not JSON (",
    }[damage]
    status, out, _ = run_cli(capsys, "verify", str(manager_dir))
    assert status == 0
    assert f"{folder}: incomplete, ignored by the manager: {reason}" in out
    status, _, err = run_cli(capsys, "verify", str(folder))
    assert status == 1
    assert f"{folder}: INCOMPLETE: {reason}" in err
    status, out, _ = run_cli(capsys, "inspect", str(manager_dir))
    assert status == 0
    assert f"  step 2  incomplete: {reason}" in out


def test_inspect_a_manager_directory_and_one_of_its_steps(manager_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "inspect", str(manager_dir))
    assert (status, err) == (0, "")
    size1 = os.path.getsize(Path(_directory.step_dir(str(manager_dir), 1)) / "state.safetensors")
    lines = out.splitlines()
    assert lines[0] == f"{manager_dir}: CheckpointManager directory, 4 step folders, 3 complete (latest: step 3)"
    assert lines[1] == f"  step 1  complete: 1 file(s), {size1 / 1024:.1f} KiB"
    assert lines[3].startswith("  step 3  complete: 2 file(s), ")
    assert lines[4] == "  step 4  incomplete: no DONE marker (its save did not finish, or is still running)"
    assert lines[5] == f"one step's files: ckptstream inspect {manager_dir} --step 3"
    status, out, _ = run_cli(capsys, "inspect", str(manager_dir), "--step", "3")
    assert status == 0
    folder = _directory.step_dir(str(manager_dir), 3)
    assert out.splitlines()[0] == f"{folder}: CheckpointManager step folder, step 3, complete, 2 rank(s)"
    for rank in range(2):
        assert f"{folder}/{_directory.file_name(rank, 2)}: ckptstream 1, 2 tensors" in out
    status, out, _ = run_cli(capsys, "inspect", str(manager_dir), "--json")
    d = json.loads(out)
    assert d["kind"] == "CheckpointManager directory"
    assert [(s["step"], s["complete"]) for s in d["steps"]] == [(1, True), (2, True), (3, True), (4, False)]
    assert d["latest"] == 3


# --- a DCP checkpoint ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint saved by two processes with ckptstream's StreamWriter (made once)."""
    work = tmp_path_factory.mktemp("dcp")
    store = work / "store"
    procs = [subprocess.Popen([sys.executable, str(HERE / "reliability" / "child_dcp_save.py"), str(work / "ckpt"),
                               str(rank), "2", str(store)], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = []
    try:
        outs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:  # none left running, whatever failed
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
    return work / "ckpt"


@pytest.fixture
def dcp_dir(dcp_two_ranks: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in dcp_two_ranks.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def rewrite_metadata(directory: Path, change: Any) -> None:
    from ckptstream.dcp import _metadata

    metadata = _metadata.read_metadata(str(directory), None, trusted=True)
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def test_verify_a_dcp_checkpoint_of_two_ranks(dcp_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "verify", str(dcp_dir))
    assert (status, err) == (0, "")
    assert out == f"{dcp_dir}: OK (DCP checkpoint: 2 rank files, 5 chunks, checksums verified)\n"
    status, out, _ = run_cli(capsys, "inspect", str(dcp_dir))
    assert status == 0
    assert out.splitlines() == [
        f"{dcp_dir}: DCP checkpoint, 2 tensors, 1 other values, 2 files",
        "  w  float32  [12, 5]  2 chunk(s)", "  v  float32  [8]  2 chunk(s)",
        "values (stored as bytes):", "  step",
        "files:",
        f"  rank-00000.safetensors  2 chunk(s), {os.path.getsize(dcp_dir / 'rank-00000.safetensors') / 1024:.1f} KiB",
        f"  rank-00001.safetensors  3 chunk(s), {os.path.getsize(dcp_dir / 'rank-00001.safetensors') / 1024:.1f} KiB",
    ]


def damage_dcp(damage: str, directory: Path, marker: Path) -> str:
    """Damage the two-rank checkpoint in ``directory`` as ``damage`` says; returns what verify
    must say. A hostile pickle would create ``marker``."""
    rank1 = directory / "rank-00001.safetensors"

    def record_of_rank1(m: Any) -> tuple[Any, Any]:
        return next((k, v) for k, v in m.storage_data.items() if v.relative_path == rank1.name)

    if damage == "flipped":
        raw = bytearray(rank1.read_bytes())
        raw[-1] ^= 0x20
        rank1.write_bytes(bytes(raw))
        return f"{rank1}: tensor "
    if damage == "missing_file":
        rank1.unlink()
        return f"{rank1}, which the metadata names, is missing"
    if damage == "no_record":
        rewrite_metadata(directory, lambda m: m.storage_data.pop(next(k for k in m.storage_data if k.fqn == "w")))
        return "the metadata names a chunk of 'w' at offsets [0, 0] but records no file for it"
    if damage == "outside":  # a copy of the rank file outside the folder: only its name may refuse it
        (directory.parent / "secret").mkdir()
        (directory.parent / "secret" / rank1.name).write_bytes(rank1.read_bytes())

        def escape(m: Any) -> None:
            k, v = record_of_rank1(m)
            m.storage_data[k] = type(v)(f"../secret/{rank1.name}", v.offset, v.length, v.key, v.crc)

        rewrite_metadata(directory, escape)
        return "is not a file name in the checkpoint's directory (a path out of it, or no name)"
    if damage == "moved_chunk":
        def shift(m: Any) -> None:
            k, v = record_of_rank1(m)
            m.storage_data[k] = type(v)(v.relative_path, v.offset + 4, v.length, v.key, v.crc)

        rewrite_metadata(directory, shift)
        return "is not where the checkpoint's .metadata records it"
    (directory / ".metadata").unlink()
    if damage == "no_metadata":
        return "INCOMPLETE: no .metadata: not a complete DCP checkpoint"
    if damage == "fifo_metadata":
        os.mkfifo(directory / ".metadata")
        return f"{directory / '.metadata'}: is a FIFO (named pipe), not a regular file"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    (directory / ".metadata").write_bytes(pickle.dumps(Payload()))
    return "if you trust this checkpoint, pass trust_metadata=True"


@pytest.mark.parametrize("damage", ["flipped", "missing_file", "no_record", "outside", "moved_chunk", "no_metadata",
                                    "fifo_metadata", "hostile_pickle"])
def test_a_damaged_dcp_checkpoint_is_named_with_its_reason(damage: str, dcp_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    expected = damage_dcp(damage, dcp_dir, marker)
    status, out, err = run_cli(capsys, "verify", str(dcp_dir))
    assert (status, out) == (1, "")
    assert expected in err
    assert not marker.exists()


def test_a_dcp_checkpoint_of_torchs_own_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.randn(32, 8), "step": 3}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")),
                 no_dist=True)
    status, out, _ = run_cli(capsys, "verify", str(tmp_path / "fs"))
    assert status == 0
    assert "1 file(s) of another writer present with the bytes the metadata records; they hold no checksums" in out
    data = next(p for p in (tmp_path / "fs").iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size - 10)
    status, _, err = run_cli(capsys, "verify", str(tmp_path / "fs"))
    assert status == 1
    assert f"{data} is {data.stat().st_size} bytes, but the metadata records a chunk at bytes" in err


def test_a_dcp_metadata_file_is_named_and_its_folder_suggested(dcp_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("verify", "inspect"):
        status, out, err = run_cli(capsys, command, str(dcp_dir / ".metadata"))
        assert (status, out) == (2, "")
        assert (f"{dcp_dir / '.metadata'}: this is a DCP checkpoint's metadata, not a checkpoint file; run "
                f"`ckptstream verify {dcp_dir}` (or inspect) on its folder") in err
        assert "header length" not in err


@pytest.mark.parametrize("kind", ["pickle", "zip"])
def test_files_of_other_formats_are_named(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.bin"
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"w": [1.0] * 1000}, protocol=4))
    else:
        torch.save({"w": torch.randn(4)}, path)
    status, _, err = run_cli(capsys, "verify", str(path))
    assert status == 2
    assert {"pickle": f"{path} is a Python pickle", "zip": f"{path} is a torch.save file"}[kind] in err
    assert "header length" not in err


def test_a_folder_without_a_checkpoint_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    status, _, err = run_cli(capsys, "verify", str(tmp_path))
    assert status == 2
    assert "a folder that holds no checkpoint" in err


def test_verify_of_several_checkpoints_exits_with_the_worst(manager_dir: Path, dcp_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (dcp_dir / "rank-00000.safetensors").unlink()
    status, out, err = run_cli(capsys, "verify", str(manager_dir), str(dcp_dir))
    assert status == 1
    assert out.count(": OK (") == 3
    assert "rank-00000.safetensors, which the metadata names, is missing" in err
    status, _, _ = run_cli(capsys, "verify", str(manager_dir), str(dcp_dir), str(tmp_path / "nope"))
    assert status == 2


# --- files: long containers and damaged headers ---------------------------------------------------


def test_inspect_collapses_long_containers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt.safetensors"
    state = {"layers": [{"w": torch.randn(2)} for _ in range(30)], "rng": {"python": random.getstate()}, "step": 9}
    ckptstream.save(state, path)
    status, out, _ = run_cli(capsys, "inspect", str(path))
    assert status == 0
    lines = out.splitlines()
    assert len(lines) < 40, out
    assert [line.split()[0] for line in lines[1:11]] == [f"layers.{i}.w" for i in range(10)]
    assert lines[11] == ("  ... 20 more tensors in 20 more items of layers (it holds 30 items, the first 10 shown; "
                         "--max-items 0 shows all)")
    values = lines[lines.index("values:") + 1 :]
    assert values[0] == "  rng.python.0: 3"
    assert values[1 : 11] == [f"  rng.python.1.{i}: {v}" for i, v in enumerate(random.getstate()[1][:10])]
    assert values[11] == ("  ... 615 more values in 615 more items of rng.python.1 (it holds 625 items, the first 10 "
                          "shown; --max-items 0 shows all)")
    assert values[12:] == ["  rng.python.2: None", "  step: 9", "structure:", "  layers: 30 tensors, 240 B"]
    status, out, _ = run_cli(capsys, "inspect", str(path), "--max-items", "3")
    assert "  ... 27 more tensors in 27 more items of layers (it holds 30 items, the first 3 shown" in out
    status, out, _ = run_cli(capsys, "inspect", str(path), "--max-items", "0")
    assert out.count("rng.python.1.") == 625
    assert "more values" not in out
    status, out, _ = run_cli(capsys, "inspect", str(path), "--json")  # the JSON holds everything
    assert len(json.loads(out)["values"]) == 628


def test_inspect_rejects_a_negative_max_items(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", str(tmp_path), "--max-items", "-1"])
    assert e.value.code == 2
    assert "must be 0 (all) or more, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(("where", "expected"), [
    ("metadata_key", "the entry '__met`data__' at byte 9 is not a tensor entry (a damaged \"__metadata__\")"),
    ("dtype", "the damage lies inside a value"),
    ("brace", "its JSON breaks at byte"),
])  # fmt: skip
def test_a_damaged_header_is_said_to_be_corrupt_and_where(where: str, expected: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"w": torch.randn(4, 4), "rng": {"python": random.getstate()}, "step": 3}, path)
    raw = bytearray(path.read_bytes())
    at = {"metadata_key": raw.find(b"__metadata__") + 5, "dtype": raw.find(b'"F32"') + 2,
          "brace": raw.find(b"{", 9)}[where]
    raw[at] ^= {"metadata_key": 0x01, "dtype": 0x01, "brace": 0x20}[where]  # a -> `, 3 -> 2, { -> [
    path.write_bytes(bytes(raw))
    status, out, err = run_cli(capsys, "verify", str(path))
    assert (status, out) == (1, "")
    assert err.startswith(f"ckptstream verify: {path}: header corrupt: its bytes 0..8192 fail their CRC-32C check")
    assert expected in err
    assert "ckptstream.structure" not in err  # no dump of the header
    assert len(err) < 500


def test_the_benchmark_and_dcp_are_imported_only_where_needed(manager_dir: Path, dcp_dir: Path) -> None:
    code = ("import sys; from ckptstream import cli; status = cli.main(sys.argv[1:]); "
            "print(status, sorted({m.split('.')[0] + '.' + m.split('.')[1] for m in sys.modules "
            "if m.startswith(('ckptstream.bench', 'ckptstream.dcp', 'torch.distributed.checkpoint'))}))")
    started = time.monotonic()
    seen = {}
    for name, args in {"file": ["verify", str(Path(_directory.step_dir(str(manager_dir), 1)) / "state.safetensors")],
                       "manager": ["inspect", str(manager_dir)], "dcp": ["verify", str(dcp_dir)]}.items():
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=child_env(),
                              timeout=120)
        seen[name] = proc.stdout.strip().splitlines()[-1]
    assert seen == {"file": "0 []", "manager": "0 []",
                    "dcp": "0 ['ckptstream.dcp', 'torch.distributed']"}, (seen, time.monotonic() - started)
