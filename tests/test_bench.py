"""``ckptstream bench``: smoke runs at tiny sizes on the CPU (real subprocesses, as a user runs it)
and unit tests of its parts: the state generator, the RSS helper, cache eviction, aggregation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstream import cli
from ckptstream.bench import cache, machine, measure, options, report, runner, sweep, systems, worker
from ckptstream.bench.multirank import Group
from ckptstream.bench.state import GiB, MiB, StateSpec, build_state, flatten, gpt_shapes, state_nbytes

TINY = str(1 / 128)  # GiB
DEFAULT_ROWS = ["ckptstream", "ckptstream load_into", "ckptstream verify=False", "torch", "torch mmap", "safetensors", "dcp"]


def bench(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run ``ckptstream bench --quick`` with its workspace in tmp_path/work; returns the JSON too."""
    work, out = tmp_path / "work", tmp_path / "bench.json"
    work.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "ckptstream.cli", "bench", "--quick", "--dir", str(work),
                           "--json", str(out), *args], capture_output=True, text=True, timeout=240,
                          env=env)
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


def assert_workspace_gone(tmp_path: Path) -> None:
    assert list((tmp_path / "work").iterdir()) == [], "temporary files were left behind"


def assert_positive(fig: dict[str, Any]) -> None:
    assert fig["gbps"] > 0 and fig["seconds"] > 0
    assert all(g > 0 for g in fig["gbps_runs"])
    assert fig["rss_per_process"] >= 0 and fig["rss_total"] >= fig["rss_per_process"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], Any]:
    tmp = tmp_path_factory.mktemp("quick")
    proc, data = bench(tmp, "--plot", str(tmp / "bench.png"))
    return tmp, proc, data


def test_quick_run_reports_every_system(quick: tuple[Path, subprocess.CompletedProcess[str], Any]) -> None:
    tmp, proc, data = quick
    assert proc.returncode == 0, proc.stderr
    assert [row["label"] for row in data["rows"]] == DEFAULT_ROWS
    for row in data["rows"]:
        assert_positive(row["cold"])
        assert_positive(row["hot"])
        assert len(row["hot"]["gbps_runs"]) == worker.HOT_RUNS  # --quick: one run, hot loads repeated
        if row["label"] in ("ckptstream", "torch", "safetensors", "dcp"):
            assert_positive(row["save"])
            assert row["save_vs_ceiling"] > 0
    ours = data["rows"][0]
    assert ours["save"]["staging"] > 0  # ckptstream's staging buffers are reported
    cost = {t["target"]: t for t in data["targets"]}["share of hot load speed that verifying costs"]
    assert cost["value"] == pytest.approx(report.verify_cost(data["rows"])) and cost["kind"] == "<="
    for kind in ("write", "read", "hot"):
        assert data["ceilings"][kind]["gbps"] > 0
    assert set(data["speedups"]) == {"torch", "torch mmap", "safetensors", "dcp"}
    assert data["cold"]["label"] in ("cold", "warm") and data["cold"]["method"] in ("drop_caches", "fadvise", "none")
    machine = data["machine"]
    assert machine["cpu"] and machine["file_system"]["fs_type"] and machine["versions"]["torch"] == torch.__version__
    assert data["failed"] == {}
    assert_workspace_gone(tmp)


def test_quick_run_prints_table_progress_and_plot(quick: tuple[Path, subprocess.CompletedProcess[str], Any]) -> None:
    tmp, proc, _ = quick
    header = next(line for line in proc.stdout.splitlines() if line.startswith("system"))
    for column in ("save GB/s", "/write", "load GB/s", "/read", "hot load GB/s", "peak RSS save"):
        assert column in header
    assert "ckptstream speedup" in proc.stdout
    assert "[1/5] raw disk and copy ceilings" in proc.stderr and "torch save 1/1" in proc.stderr
    assert (tmp / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def without_safetensors(tmp_path: Path) -> dict[str, str]:
    """An environment where safetensors fails to import, as if it were not installed."""
    shadow = tmp_path / "shadow" / "safetensors"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))


def test_not_enough_disk_space_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["bench", "--dir", str(tmp_path), "--size-gib", "1000000"])
    assert cli.main(["bench", "--dir", str(tmp_path), "--size-gib", "1000000"]) == 2 and args.size_gib == 1e6
    err = capsys.readouterr().err
    assert "not enough free disk space" in err and str(tmp_path) in err and "--size-gib" in err
    assert list(tmp_path.iterdir()) == []


def test_ranks_2_quick_with_gloo_and_a_missing_peer(tmp_path: Path) -> None:
    # few tensors: DCP's per-tensor planning would take most of the test's time
    proc, data = bench(tmp_path, "--ranks", "2", "--systems", "ckptstream", "dcp", "safetensors", "--cold", "fadvise",
                       "--tensors", "16", "--tensor-kib", "64", env=without_safetensors(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert any("safetensors skipped" in note and "not installed" in note for note in data["notes"])
    assert "note: safetensors skipped" in proc.stdout
    assert data["mode"] == "ranks" and data["state"]["ranks"] == 2
    assert [row["label"] for row in data["rows"]] == ["ckptstream", "dcp"]
    for row in data["rows"]:
        assert_positive(row["save"])
        assert_positive(row["cold"])
        assert row["hot"] is None
        assert row["bytes"] == 2 * data["state"]["bytes_per_rank"]
        assert len(data["raw"]["systems"][row["system"]]) == 2  # one result per rank
    assert data["ceilings"]["write"]["gbps"] > 0 and data["ceilings"]["read"]["gbps"] > 0
    assert "slowest save s" in proc.stdout and "RSS total" in proc.stdout
    assert_workspace_gone(tmp_path)


def test_sweep_in_process(tmp_path: Path) -> None:
    # the worker's side of --sweep, run here: a child process would add seconds of imports
    args = cli.build_parser().parse_args(["bench", "--sweep", "--quick", "--size-gib", TINY, "--dir", str(tmp_path),
                                          "--sweep-buffer-mib", "1,4", "--sweep-num-buffers", "2",
                                          "--sweep-io-threads", "1,2", "--cold", "fadvise"])
    opts = options.resolve(args)
    job = runner.base_job(opts, "sweep", str(tmp_path), cache.Cold.FADVISE)
    job["spec"] = {"size_bytes": 0, "tensors": 1, "tensor_kib": 4096, "seed": 0}
    result = sweep.run_job(job, Group("cpu"))
    rows = result["rows"]
    assert [(r["buffer_size"] // MiB, r["num_buffers"], r["io_threads"]) for r in rows] == [(1, 2, 1), (1, 2, 2), (4, 2, 1), (4, 2, 2)]
    assert all(r[k] > 0 for r in rows for k in ("write", "cold", "hot"))
    text = sweep.render(result, report.ceiling_figures([result["ceilings"]]), "cpu", "cold")
    assert "best write" in text and "current defaults" in text
    assert list(Path(job["dir"]).iterdir()) == []


def test_gpt_state_has_a_transformer_mix() -> None:
    shapes = gpt_shapes(8 * GiB)
    assert len(shapes) >= 100 and 4 * len(shapes) >= 400  # hundreds of tensors at 8 GiB
    assert StateSpec(8 * GiB).nbytes() == pytest.approx(8 * GiB, rel=0.05)
    spec = StateSpec(2 * MiB, seed=3)
    state = build_state(spec, "cpu")
    assert set(state) == {"model", "master", "optim", "step"} and set(state["optim"]) == {"exp_avg", "exp_avg_sq"}
    names = state["model"].keys()
    assert {"wte.weight", "wpe.weight", "h.0.attn.c_attn.weight", "h.0.mlp.c_proj.bias", "ln_f.weight"} <= set(names)
    for group, dtype in (("model", torch.bfloat16), ("master", torch.float32)):
        assert all(t.dtype == dtype for t in state[group].values())
    for name in names:
        shapes_here = {state["model"][name].shape, state["master"][name].shape, state["optim"]["exp_avg"][name].shape}
        assert len(shapes_here) == 1
    sizes = {t.numel() for t in state["master"].values()}
    assert len(sizes) >= 5  # embeddings, attention, MLP, biases and norms differ
    assert all(t.count_nonzero() > 0 for t in flatten(state).values())
    assert all((t > 0).all() for t in state["optim"]["exp_avg_sq"].values())
    assert state_nbytes(state) == spec.nbytes()
    again, other = build_state(spec, "cpu"), build_state(StateSpec(2 * MiB, seed=4), "cpu")
    assert torch.equal(again["master"]["wte.weight"], state["master"]["wte.weight"])
    assert not torch.equal(other["master"]["wte.weight"], state["master"]["wte.weight"])


def test_many_small_tensors_state() -> None:
    spec = StateSpec(tensors=300, tensor_kib=1)
    state = build_state(spec, "cpu")
    tensors = flatten(state)
    assert len(tensors) == 300 and all(t.numel() * t.element_size() == 1024 for t in tensors.values())
    assert spec.nbytes() == state_nbytes(state) == 300 * 1024


def test_peak_rss_sees_a_freed_allocation() -> None:
    with measure.PeakRss() as rss:
        block = torch.ones(64 * MiB, dtype=torch.uint8)  # touched pages
        del block
    assert rss.method == "VmHWM" and rss.growth >= 60 * MiB
    with measure.PeakRss() as idle:
        pass
    assert idle.growth < 16 * MiB


def test_peak_rss_falls_back_to_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "_reset_high_water_mark", lambda: False)
    with measure.PeakRss() as rss:
        block = torch.ones(64 * MiB, dtype=torch.uint8)
        time.sleep(0.05)
        del block
    assert rss.method == "sampled" and rss.growth >= 60 * MiB


def test_fadvise_makes_a_file_cold(tmp_path: Path) -> None:
    if machine.mount_of(str(tmp_path))["fs_type"] in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages are the file itself")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 * MiB))
    path.read_bytes()
    assert cache.resident_fraction([str(path)]) == pytest.approx(1.0)
    cache.evict(cache.Cold.FADVISE, [str(path)])
    assert cache.resident_fraction([str(path)]) <= cache.STILL_COLD
    assert cache.label(cache.Cold.FADVISE, 0.0) == "cold"
    assert cache.label(cache.Cold.FADVISE, 0.5) == "warm" and cache.label(cache.Cold.NONE, 0.0) == "warm"


def test_aggregate_rate_is_set_by_the_slowest_rank() -> None:
    def run(seconds: float, rss: int) -> dict[str, Any]:
        return {"seconds": seconds, "rss": rss, "rss_method": "VmHWM", "staging": 0}

    fig = report.phase_figure([[run(1.0, 10), run(2.0, 30), run(1.0, 10)], [run(2.0, 20), run(1.0, 10), run(4.0, 40)]],
                              total_bytes=8 * 10**9)
    assert fig["seconds_runs"] == [2.0, 2.0, 4.0] and fig["gbps"] == pytest.approx(4.0)
    assert fig["rss_per_process"] == 30 and fig["rss_total"] == 40


def test_verify_cost_compares_the_hot_loads_with_and_without_checksums() -> None:
    rows = [{"label": "ckptstream", "hot": {"gbps": 9.0}}, {"label": "torch", "hot": {"gbps": 1.0}},
            {"label": "ckptstream verify=False", "hot": {"gbps": 10.0}}]
    assert report.verify_cost(rows) == pytest.approx(0.1)
    assert report.verify_cost(rows[:2]) is None
    assert report.verify_cost([dict(rows[0], hot=None), rows[2]]) is None


def test_a_failing_load_is_reported_and_the_other_loads_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: str, like: Any, device: str, world: int) -> Any:
        raise RuntimeError("simulated loader bug")

    torch_system = systems.SYSTEMS["torch"]
    variants = (torch_system.variants[0], systems.Variant("torch broken", broken))
    monkeypatch.setitem(systems.SYSTEMS, "torch", dataclasses.replace(torch_system, variants=variants))
    job = {"system": "torch", "device": "cpu", "repeat": 2, "cold": "fadvise", "dir": str(tmp_path / "torch"),
           "spec": {"size_bytes": 0, "tensors": 8, "tensor_kib": 4, "seed": 0}, "hot": True, "all_variants": True}
    result = worker.run_system(job, Group("cpu"))
    assert result["load_errors"] == {"torch broken": "RuntimeError: simulated loader bug"}
    assert list(result["runs"]["loads"]) == ["torch"]
    assert len(result["runs"]["save"]) == 2 and len(result["runs"]["loads"]["torch"]["cold"]) == 2
    assert len(result["runs"]["loads"]["torch"]["hot"]) == 2 * -(-worker.HOT_RUNS // 2)
    assert list((tmp_path / "torch").iterdir()) == []
