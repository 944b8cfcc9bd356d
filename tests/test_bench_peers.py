"""The fast loaders of the ``bench-peers`` extra as systems of ``ckptstream bench``: fastsafetensors,
InstantTensor, Run:ai Model Streamer and tensorizer. Each loads exactly the saved bytes, on every
device it loads to; a run lists each peer as a row, and each one that cannot run here (its
package absent, a device it does not load to) as a row that says why. The peers are imported by
the benchmark only when asked for, so these tests run with and without them installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstream import cli
from ckptstream.bench import machine, options, report, systems, text, training
from ckptstream.bench.state import StateSpec, build_state, flat_tensors
from tests.helpers import assert_bytes_equal, random_tensor
from tests.test_bench import _fabricated_raw

TINY = 1 / 1024  # GiB: about 1 MiB of state


def installed(name: str) -> bool:
    return importlib.util.find_spec(systems.SYSTEMS[name].module) is not None


def require(name: str) -> None:
    if not installed(name):
        pytest.skip(f"{systems.SYSTEMS[name].module} is not installed (pip install 'ckptstream[bench-peers]')")


def peer_state(device: torch.device) -> dict[str, Any]:
    """The benchmark's GPT-like state (bf16 weights, fp32 master weights and moments), with tensors
    of odd byte sizes in front so that most tensors after them sit at offsets their dtype does not
    divide: a loader must not assume aligned offsets."""
    state = build_state(StateSpec(256 << 10, seed=7), device)
    state["odd"] = {"bf16x3": random_tensor(3, torch.bfloat16, device), "u8x5": random_tensor(5, torch.uint8, device),
                    "f64x7": random_tensor(7, torch.float64, device)}
    return {"odd": state.pop("odd"), **state}


@contextlib.contextmanager
def peer_warnings() -> Iterator[None]:
    """A peer's own warnings (its choice of I/O backend on this machine, say) are shown, not
    turned into errors: they are not this benchmark's to fix."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"peer warning: {w.category.__name__}: {w.message}")


@pytest.mark.parametrize("name", systems.LOAD_PEERS)
def test_each_peer_loads_exactly_the_saved_bytes(name: str, device: torch.device, tmp_path: Path) -> None:
    system = systems.SYSTEMS[name]
    variants = system.variants_on(device.type)
    if not variants:
        pytest.skip(system.devices_note)
    require(name)
    state = peer_state(device)
    path = system.path(str(tmp_path), 0)
    want = flat_tensors(state)
    with peer_warnings():
        system.save(state, path, 1)  # its own format (tensorizer) or the safetensors file ckptstream writes
    for v in variants:
        with peer_warnings():
            loaded = v.load(path, state, str(device), 1)
        assert sorted(loaded) == sorted(want), v.label
        for key, tensor in want.items():
            assert loaded[key].device.type == device.type, (v.label, key)
            assert_bytes_equal(loaded[key], tensor)
        del loaded


def bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    work, out = tmp_path / "work", tmp_path / "bench.json"
    work.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "ckptstream.cli", "bench", "--quick", "--dir", str(work),
                           "--json", str(out), *args], capture_output=True, text=True, timeout=240)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_a_run_lists_every_peer_it_was_asked_for(tmp_path: Path) -> None:
    """A row per peer that ran (loads only: its file was written before the clock), and a row
    with the reason for each one that could not run here: never silently dropped."""
    peer_labels = [v.label for name in systems.LOAD_PEERS for v in systems.SYSTEMS[name].variants]
    proc, data = bench(tmp_path, "--device", "cpu", "--hot-runs", "2", "--systems", "ckptstream", *systems.LOAD_PEERS,
                       "--variants", "ckptstream", *peer_labels)
    assert proc.returncode == 0, proc.stderr
    ran = [n for n in systems.LOAD_PEERS if installed(n) and systems.SYSTEMS[n].variants_on("cpu")]
    labels = [row["label"] for row in data["rows"]]
    assert [label for label in labels if label.startswith("ckptstream")] == ["ckptstream"]  # --variants
    assert [label for label in labels if label in systems.LOAD_PEERS] == ran
    for row in data["rows"]:
        if row["system"] in systems.LOAD_PEERS:
            assert row["save"] is None  # its file was not written on the clock
            assert row["cold"]["gbps"] > 0
            assert len(row["hot"]["gbps_runs"]) == 2
            assert data["speedups"][row["label"]]["save"] is None
            assert data["speedups"][row["label"]]["cold"] > 0
    not_run = data["not_run"]
    assert set(not_run) == set(systems.LOAD_PEERS) - set(ran)
    assert "CUDA devices only" in not_run["instanttensor"]
    for name in set(not_run) - {"instanttensor"}:
        assert "is not installed" in not_run[name], not_run[name]
    assert data["failed"] == {}
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("system"))
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in lines[header + 2:] if line.strip()}
    for name in not_run:
        assert re.match(rf"{re.escape(name)}\s+not run(\s+-)+$", rows[name]), rows[name]
        assert not_run[name] in proc.stdout  # the reason, under the table
    for name in ran:
        assert re.match(rf"{re.escape(name)}\s+-\s+-\s+\d", rows[name]), rows[name]  # no save figure
    assert list((tmp_path / "work").iterdir()) == []


def test_nvrx_async_save_says_why_it_cannot_run_on_the_cpu(tmp_path: Path) -> None:
    result = training.run(TINY, device="cpu", systems=["nvrx.async_save"], directory=str(tmp_path),
                          checkpoints=1, isolate=False)
    error = result["systems"]["nvrx.async_save"]["error"]
    assert error.startswith("RuntimeError: nvrx.async_save needs a CUDA device"), error
    assert "could not run: RuntimeError: nvrx.async_save needs a CUDA device" in training.render(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_the_async_peers_on_a_gpu(tmp_path: Path) -> None:
    """DCP with the pinned stager and nvidia-resiliency-ext's async save, each in its own process,
    over the same steps, every write durable by the end."""
    wanted = ["dcp.async_save+pinned"] + (["nvrx.async_save"] if importlib.util.find_spec("nvidia_resiliency_ext")
                                          else [])
    result = training.run(TINY, device="cuda", systems=wanted, directory=str(tmp_path), checkpoints=1)
    for name in wanted:
        row = result["systems"][name]
        assert "error" not in row, (name, row)
        assert row["steps"] == result["steps"]
        assert row["durable_s"] > 0
        assert row["lost_s"] == pytest.approx(row["blocked_s"] + row["slowed_s"] + row["waited_s"])
    assert list(tmp_path.iterdir()) == []


def test_variants_must_name_a_load_of_each_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*args: str) -> str:
        assert cli.main(["bench", "--dir", str(tmp_path), "--systems", "ckptstream", "torch", *args]) == 2
        return capsys.readouterr().err

    assert "unknown load variant(s) ['tensorizer']" in run("--variants", "ckptstream", "torch", "tensorizer")
    assert "leaves ['torch'] without a load to run" in run("--variants", "ckptstream load_into")
    assert "'torch mmap'" in run("--variants", "ckptstream load_into")
    assert list(tmp_path.iterdir()) == []


def test_targets_against_each_fast_loader_that_ran(tmp_path: Path) -> None:
    opts = dataclasses.replace(options.resolve_options(cli.build_parser().parse_args(
        ["bench", "--dir", str(tmp_path), "--size-gib", "8"])), device="cuda")
    raw = _fabricated_raw(opts.spec.nbytes())
    gb = opts.spec.nbytes() / 1e9  # seconds at 1 GB/s; ckptstream loads at 1.5 GB/s cold and 8 GB/s hot
    peer = raw["systems"]["safetensors"][0]
    fig = peer["runs"]["save"][0]
    loads = {"cold": [dict(fig, seconds=gb / 2)], "hot": [dict(fig, seconds=gb / 4)]}
    raw["systems"]["runai-streamer"] = [dict(peer, runs={"save": [], "loads": {"runai-streamer": loads}})]
    raw["skipped"] = {"instanttensor": "instanttensor skipped: instanttensor is not installed"}
    rep = report.build_report(opts, raw, machine.machine_description(str(tmp_path)))
    judged = {t["target"]: (round(t["value"], 3), t["ok"]) for t in rep["targets"]}
    assert judged["cold load speedup over runai-streamer"] == (0.75, False)
    assert judged["hot load speedup over runai-streamer"] == (2.0, True)
    assert not any("instanttensor" in t for t in judged)  # a peer that did not run has no target
    row = next(r for r in rep["rows"] if r["label"] == "runai-streamer")
    assert row["save"] is None
    assert row["save_vs_ceiling"] is None
    assert rep["speedups"]["runai-streamer"] == {"save": None, "cold": 0.75, "hot": 2.0}
    printed = text.render_report(rep)
    assert re.search(r"\nrunai-streamer +- +- +2\.00 ", printed)
    assert re.search(r"\nvs runai-streamer +- +0\.75x +2\.00x\n", printed)
    assert re.search(r"\ninstanttensor +not run( +-)+\n", printed)
    assert "\ninstanttensor skipped: instanttensor is not installed\n" in printed
