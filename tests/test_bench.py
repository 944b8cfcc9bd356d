"""``ckptstream bench``: smoke runs at tiny sizes on the CPU (real subprocesses, as a user runs it)
and unit tests of its parts: the state generator, the RSS helper, cache eviction, aggregation,
the targets, and the package's own structure (public API only, imports one way)."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import json
import mmap
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli
from ckptstream.bench import cache, machine, measure, options, report, runner, sweep, systems, text, worker
from ckptstream.bench.formats import GiB, MiB
from ckptstream.bench.multirank import Group
from ckptstream.bench.state import StateSpec, build_state, flat_tensors, gpt_shapes, state_nbytes
from tests.helpers import needs_ctrl_c

TINY = str(1 / 128)  # GiB
DEFAULT_ROWS = ["ckptstream", "ckptstream load_into", "ckptstream checksum=False",
                *(["ckptstream mmap=False"] if not torch.cuda.is_available() else []),  # on CPU runs only
                "torch", "torch mmap", "safetensors", "dcp"]


def bench(tmp_path: Path, *args: str,
          env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Any]:
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
    assert fig["gbps"] > 0
    assert fig["seconds"] > 0
    assert all(g > 0 for g in fig["gbps_runs"])
    assert fig["rss_per_process"] >= 0
    assert fig["rss_total"] >= fig["rss_per_process"]


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
        assert len(row["hot"]["gbps_runs"]) == options.QUICK_HOT_RUNS  # --quick: one run, hot loads repeated
        if row["label"] in ("ckptstream", "torch", "safetensors", "dcp"):
            assert_positive(row["save"])
            assert row["save_vs_ceiling"] > 0
    ours = data["rows"][0]
    assert ours["save"]["staging"] > 0  # ckptstream's staging buffers are reported
    assert data["verify_cost"] == pytest.approx(report.verify_cost(data["rows"]))
    assert data["targets"] == []
    assert data["targets_set_for"] is None
    assert data["ckptstream_settings"] == _settings_now()
    for kind in ("write", "read", "hot"):
        ceiling = data["ceilings"][kind]
        assert ceiling["gbps"] == max(ceiling["by_probe"].values()) > 0
        assert ceiling["by_probe"][ceiling["how"]] == ceiling["gbps"]  # the mechanism that reached it
    # --quick: one thread; the cold read tries O_DIRECT and one readahead range
    assert set(data["ceilings"]["read"]["by_probe"]) == {"direct 1x1MiB", "ranges 1x1MiB"}
    assert data["ceilings"]["memory"]["gbps"] > 0
    assert f"({data['ceilings']['read']['how']})" in proc.stdout
    assert set(data["speedups"]) == {"torch", "torch mmap", "safetensors", "dcp"}
    assert data["cold"]["label"] in ("cold", "warm")
    assert data["cold"]["method"] in ("drop_caches", "fadvise", "none")
    machine = data["machine"]
    assert machine["cpu"]
    assert machine["file_system"]["fs_type"]
    assert machine["versions"]["torch"] == torch.__version__
    assert data["failed"] == {}
    assert_workspace_gone(tmp)


def test_quick_run_prints_table_progress_and_plot(quick: tuple[Path, subprocess.CompletedProcess[str], Any]) -> None:
    tmp, proc, _ = quick
    header = next(line for line in proc.stdout.splitlines() if line.startswith("system"))
    for column in ("save GB/s", "save/ceiling", "load GB/s", "load/ceiling", "hot load GB/s", "hot load/ceiling",
                   "save RSS growth", "load RSS growth", "staging allocated"):
        assert column in header
    assert "ckptstream speedup" in proc.stdout
    assert "verifying checksums cost" in proc.stdout
    assert "the runs spread" in proc.stdout or "within noise" in proc.stdout  # several hot loads each
    assert "targets (" not in proc.stdout
    assert "MISSED" not in proc.stdout
    assert "[1/5] raw disk and copy ceilings" in proc.stderr
    assert "torch save 1/1" in proc.stderr
    assert (tmp / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def without_safetensors(tmp_path: Path) -> dict[str, str]:
    """An environment where safetensors fails to import, as if it were not installed."""
    shadow = tmp_path / "shadow" / "safetensors"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))


def test_not_enough_disk_space_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["bench", "--dir", str(tmp_path), "--size-gib", "1000000"])
    assert cli.main(["bench", "--dir", str(tmp_path), "--size-gib", "1000000"]) == 2
    assert args.size_gib == 1e6
    err = capsys.readouterr().err
    assert "not enough free disk space" in err
    assert str(tmp_path) in err
    assert "--size-gib" in err
    assert list(tmp_path.iterdir()) == []


def test_ranks_2_quick_with_gloo_and_a_missing_peer(tmp_path: Path) -> None:
    # few tensors: DCP's per-tensor planning would take most of the test's time
    proc, data = bench(tmp_path, "--ranks", "2", "--systems", "ckptstream", "dcp", "safetensors", "--cold", "fadvise",
                       "--tensors", "16", "--tensor-kib", "64", env=without_safetensors(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert any("safetensors skipped" in note and "not installed" in note for note in data["notes"])
    assert set(data["not_run"]) == {"safetensors"}
    assert "safetensors skipped: safetensors.torch is not installed" in data["not_run"]["safetensors"]
    assert re.search(r"\nsafetensors +not run( +-)+\n", proc.stdout)  # its row in the table
    assert f"\n{data['not_run']['safetensors']}\n" in proc.stdout  # and why, under the table
    assert data["mode"] == "ranks"
    assert data["state"]["ranks"] == 2
    assert [row["label"] for row in data["rows"]] == ["ckptstream", "dcp"]
    for row in data["rows"]:
        assert_positive(row["save"])
        assert_positive(row["cold"])
        assert row["hot"] is None
        assert row["bytes"] == 2 * data["state"]["bytes_per_rank"]
        assert len(data["raw"]["systems"][row["system"]]) == 2  # one result per rank
    assert data["ceilings"]["write"]["gbps"] > 0
    assert data["ceilings"]["read"]["gbps"] > 0
    assert "slowest save s" in proc.stdout
    assert "RSS total save" in proc.stdout
    assert "RSS total load" in proc.stdout
    assert_workspace_gone(tmp_path)


def test_sweep_in_process(tmp_path: Path) -> None:
    # the worker's side of --sweep, run here: a child process would add seconds of imports
    args = cli.build_parser().parse_args(["bench", "--sweep", "--quick", "--size-gib", TINY, "--dir", str(tmp_path),
                                          "--sweep-buffer-mib", "1,4", "--sweep-num-buffers", "2",
                                          "--sweep-io-threads", "1,2", "--cold", "fadvise"])
    opts = options.resolve_options(args)
    job = runner.base_job(opts, "sweep", str(tmp_path), cache.Cold.FADVISE)
    job["spec"] = {"size_bytes": 0, "tensors": 1, "tensor_kib": 4096, "seed": 0}
    result = sweep.run_sweep(job, Group("cpu"))
    rows = result["rows"]
    combos = [(r["buffer_size"] // MiB, r["num_buffers"], r["io_threads"]) for r in rows]
    assert combos == [(1, 2, 1), (1, 2, 2), (4, 2, 1), (4, 2, 2)]
    assert all(r[k] > 0 for r in rows for k in ("write", "cold", "hot"))
    printed = sweep.render_sweep(result, report.ceiling_figures([result["ceilings"]]), "cpu", "cold")
    assert "best write" in printed
    assert "current defaults" in printed
    assert list(Path(job["dir"]).iterdir()) == []


def test_gpt_state_has_a_transformer_mix() -> None:
    shapes = gpt_shapes(8 * GiB)
    assert len(shapes) >= 100
    assert 4 * len(shapes) >= 400
    assert StateSpec(8 * GiB).nbytes() == pytest.approx(8 * GiB, rel=0.05)
    spec = StateSpec(2 * MiB, seed=3)
    state = build_state(spec, "cpu")
    assert set(state) == {"model", "master", "optim", "step"}
    assert set(state["optim"]) == {"exp_avg", "exp_avg_sq"}
    names = state["model"].keys()
    assert {"wte.weight", "wpe.weight", "h.0.attn.c_attn.weight", "h.0.mlp.c_proj.bias", "ln_f.weight"} <= set(names)
    for group, dtype in (("model", torch.bfloat16), ("master", torch.float32)):
        assert all(t.dtype == dtype for t in state[group].values())
    for name in names:
        shapes_here = {state["model"][name].shape, state["master"][name].shape, state["optim"]["exp_avg"][name].shape}
        assert len(shapes_here) == 1
    sizes = {t.numel() for t in state["master"].values()}
    assert len(sizes) >= 5  # embeddings, attention, MLP, biases and norms differ
    assert all(t.count_nonzero() > 0 for t in flat_tensors(state).values())
    assert all((t > 0).all() for t in state["optim"]["exp_avg_sq"].values())
    assert state_nbytes(state) == spec.nbytes()
    again, other = build_state(spec, "cpu"), build_state(StateSpec(2 * MiB, seed=4), "cpu")
    assert torch.equal(again["master"]["wte.weight"], state["master"]["wte.weight"])
    assert not torch.equal(other["master"]["wte.weight"], state["master"]["wte.weight"])


def test_many_small_tensors_state() -> None:
    spec = StateSpec(tensors=300, tensor_kib=1)
    state = build_state(spec, "cpu")
    tensors = flat_tensors(state)
    assert len(tensors) == 300
    assert all(t.numel() * t.element_size() == 1024 for t in tensors.values())
    assert spec.nbytes() == state_nbytes(state) == 300 * 1024


def touched_pages(nbytes: int) -> None:
    """``nbytes`` of new resident memory, then freed: an anonymous mapping of its own, whose every
    page is written (an allocator's block could reuse pages an earlier test left resident)."""
    with mmap.mmap(-1, nbytes) as block:
        for at in range(0, nbytes, mmap.PAGESIZE):
            block[at] = 1


def test_peak_rss_sees_a_freed_allocation() -> None:
    with measure.PeakRss() as rss:
        touched_pages(64 * MiB)
    assert rss.method == "VmHWM"
    assert rss.growth >= 60 * MiB
    with measure.PeakRss() as idle:
        pass
    assert idle.growth < 16 * MiB


def test_peak_rss_falls_back_to_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "_reset_high_water_mark", lambda: False)
    with mmap.mmap(-1, 64 * MiB) as block, measure.PeakRss() as rss:
        for at in range(0, 64 * MiB, mmap.PAGESIZE):
            block[at] = 1
        time.sleep(0.05)
    assert rss.method == "sampled"
    assert rss.growth >= 60 * MiB


def test_fadvise_makes_a_file_cold(tmp_path: Path) -> None:
    if machine.mount_of(str(tmp_path))["fs_type"] in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages are the file itself")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 * MiB))
    path.read_bytes()
    assert cache.resident_fraction([str(path)]) == pytest.approx(1.0)
    cache.evict(cache.Cold.FADVISE, [str(path)])
    evicted = cache.resident_fraction([str(path)])
    assert evicted is not None
    assert evicted <= cache.STILL_COLD
    assert cache.cold_label(cache.Cold.FADVISE, 0.0) == "cold"
    assert cache.cold_label(cache.Cold.FADVISE, 0.5) == "warm"
    assert cache.cold_label(cache.Cold.NONE, 0.0) == "warm"


def test_aggregate_rate_is_set_by_the_slowest_rank() -> None:
    def run(seconds: float, rss: int) -> dict[str, Any]:
        return {"seconds": seconds, "rss": rss, "rss_method": "VmHWM", "staging": 0}

    fig = report.phase_figure([[run(1.0, 10), run(2.0, 30), run(1.0, 10)], [run(2.0, 20), run(1.0, 10), run(4.0, 40)]],
                              total_bytes=8 * 10**9)
    assert fig["seconds_runs"] == [2.0, 2.0, 4.0]
    assert fig["gbps"] == pytest.approx(4.0)
    assert fig["rss_per_process"] == 30
    assert fig["rss_total"] == 40


def test_verify_cost_compares_the_hot_loads_with_and_without_checksums() -> None:
    rows = [{"label": "ckptstream", "hot": {"gbps": 9.0}}, {"label": "torch", "hot": {"gbps": 1.0}},
            {"label": "ckptstream checksum=False", "hot": {"gbps": 10.0}}]
    assert report.verify_cost(rows) == pytest.approx(0.1)
    assert report.verify_cost(rows[:2]) is None
    assert report.verify_cost([dict(rows[0], hot=None), rows[2]]) is None


def test_a_verify_cost_within_the_runs_noise_is_said_to_be_so() -> None:
    """The cost of verifying is a difference of two medians: where the hot loads' own runs spread
    more than it (interquartile range over the median), it is reported as within noise."""
    def rows(on: list[float], off: list[float]) -> list[dict[str, Any]]:
        return [{"label": "ckptstream", "hot": {"gbps": statistics.median(on), "gbps_runs": on}},
                {"label": "ckptstream checksum=False", "hot": {"gbps": statistics.median(off), "gbps_runs": off}}]

    noisy = rows([0.35, 0.33, 0.41, 0.36, 0.43, 0.41, 0.43, 0.40, 0.36], [0.47, 0.35, 0.37, 0.44, 0.44, 0.27, 0.51,
                                                                           0.49, 0.36])  # a CPU machine's --quick
    cost, noise = report.verify_cost(noisy), report.verify_noise(noisy)
    assert cost is not None
    assert noise is not None
    assert cost == pytest.approx(1 - 0.40 / 0.44)
    assert noise == pytest.approx((0.47 - 0.36) / 0.44)  # the larger spread: checksum=False's
    within = "verifying checksums cost within noise:"
    assert text._verify_line(cost, noise) == (f"{within} +9.1% of ckptstream's hot load speed, while the hot loads' "
                                              "runs spread 25.0% (ckptstream against ckptstream checksum=False)")
    assert text._verify_line(-0.14, noise).startswith(f"{within} -14.0%")
    steady = rows([9.4, 9.41, 9.39, 9.4], [10.0, 10.02, 9.99, 10.0])
    cost, noise = report.verify_cost(steady), report.verify_noise(steady)
    assert cost is not None
    assert noise is not None
    assert noise < 0.01
    assert text._verify_line(cost, noise) == ("verifying checksums cost 6.0% of ckptstream's hot load speed (the runs "
                                              f"spread {noise:.1%}; ckptstream against ckptstream checksum=False)")
    single = rows([9.4], [10.0])
    assert report.verify_noise(single) is None
    assert text._verify_line(0.06, None).endswith("(ckptstream against ckptstream checksum=False; one run each)")


def test_a_failing_load_is_reported_and_the_other_loads_still_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
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
    assert len(result["runs"]["save"]) == 2
    assert len(result["runs"]["loads"]["torch"]["cold"]) == 2
    assert len(result["runs"]["loads"]["torch"]["hot"]) == 2 * -(-worker.HOT_RUNS // 2)
    assert list((tmp_path / "torch").iterdir()) == []


def _settings_now() -> dict[str, int]:
    with ckptstream.settings() as now:
        pass
    return {"buffer_size": now.buffer_size, "num_buffers": now.num_buffers, "io_threads": now.io_threads}


def test_many_small_tensors_run_every_peer_with_staging_options(tmp_path: Path) -> None:
    # every peer against ckptstream's own row; its other variants run in the `quick` fixture
    proc, data = bench(tmp_path, "--tensors", "200", "--tensor-kib", "1", "--hot-runs", "1",
                       "--variants", "ckptstream", "torch", "safetensors", "dcp",
                       "--buffer-mib", "4", "--num-buffers", "2", "--io-threads", "2")
    assert proc.returncode == 0, proc.stderr
    assert [row["label"] for row in data["rows"]] == ["ckptstream", "torch", "safetensors", "dcp"]
    assert data["state"]["kind"] == "small"
    assert data["state"]["bytes_per_rank"] == 200 * 1024
    for peer in ("torch", "safetensors", "dcp"):  # every phase compared with every peer
        assert all(data["speedups"][peer][p] > 0 for p in ("save", "cold", "hot")), data["speedups"][peer]
    assert data["ckptstream_settings"] == {"buffer_size": 4 * MiB, "num_buffers": 2, "io_threads": 2}
    assert data["rows"][0]["save"]["staging"] <= 2 * 4 * MiB
    assert data["targets"] == []
    speedup_header = next(line for line in proc.stdout.splitlines() if line.startswith("ckptstream speedup"))
    assert "save" in speedup_header
    assert "load" in speedup_header
    assert "hot load" in speedup_header
    assert "save s" in proc.stdout
    assert ("ckptstream settings: staging of up to 2 x 4.0 MiB (a transfer allocates the buffers its chunks need), "
            "2 I/O threads") in proc.stdout
    assert_workspace_gone(tmp_path)


def test_staging_options_are_checked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--num-buffers", "0"])
    args = cli.build_parser().parse_args(["bench", "--dir", str(tmp_path), "--buffer-mib", "2", "--io-threads", "3"])
    assert options.resolve_options(args).staging == {"buffer_size": 2 * MiB, "io_threads": 3}
    assert options.resolve_options(cli.build_parser().parse_args(["bench", "--dir", str(tmp_path)])).staging == {}


def test_quick_takes_few_hot_loads_and_says_what_a_run_costs(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def resolved(*more: str) -> options.Options:
        return options.resolve_options(cli.build_parser().parse_args(["bench", "--dir", str(tmp_path), *more]))

    assert resolved("--quick").hot_runs == options.QUICK_HOT_RUNS < worker.HOT_RUNS
    assert resolved("--quick", "--hot-runs", "5").hot_runs == 5
    assert resolved().hot_runs is None  # the worker's HOT_RUNS
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert f"{options.QUICK_HOT_RUNS} hot loads per variant" in said
    assert "a run takes a minute or more on a busy 2-core machine" in said


def _fig(seconds: float, rss: int = 0, staging: int = 0) -> dict[str, Any]:
    return {"seconds": seconds, "rss": rss, "rss_method": "VmHWM", "staging": staging, "resident": 0.0}


def _fabricated_raw(nbytes: int, ranks: int = 1) -> dict[str, Any]:
    """Raw results as the workers write them, per rank: ckptstream misses some targets (saves at
    half the write ceiling, verifying costs 20%); the peers are slower; saves grow RSS by
    200 MiB, loads by 50 MiB."""
    def system(save_s: float, loads: dict[str, tuple[float, float]], staging: int = 0) -> list[dict[str, Any]]:
        runs = {"save": [_fig(save_s, 200 * MiB, staging)],
                "loads": {label: {"cold": [_fig(c, 50 * MiB, staging)], "hot": [_fig(h, 50 * MiB, staging)]}
                          for label, (c, h) in loads.items()}}
        return [{"bytes": nbytes, "tensors": 496, "runs": runs, "load_errors": {}} for _ in range(ranks)]

    gb = nbytes / 1e9  # seconds at 1 GB/s
    ceiling = {"bytes": nbytes, "block": 64 * MiB, "direct": True, "resident": [0.0],
               "write": {"1": [gb / 2]}, "read": {"1": [gb / 2]}, "hot": {"1": [gb / 20]}}
    return {"cold_method": "drop_caches", "notes": [], "failed": {}, "ceilings": [ceiling] * ranks, "systems": {
        "ckptstream": system(gb, {"ckptstream": (gb / 1.5, gb / 8), "ckptstream checksum=False": (gb / 1.6, gb / 10)},
                             staging=128 * MiB),
        "torch": system(gb * 4, {"torch": (gb * 2, gb), "torch mmap": (gb, gb / 5)}),
        "safetensors": system(gb * 4, {"safetensors": (gb, gb / 5)}),
        "dcp": system(gb * 4, {"dcp": (gb * 2, gb)}),
    }}


def _fabricated_report(tmp_path: Path, device: str, *more: str) -> dict[str, Any]:
    opts = options.resolve_options(cli.build_parser().parse_args(["bench", "--dir", str(tmp_path), *more]))
    opts = dataclasses.replace(opts, device=device)  # no GPU here: the report only reads the option
    raw = _fabricated_raw(opts.spec.nbytes(), opts.ranks)
    return report.build_report(opts, raw, dict(machine.machine_description(str(tmp_path)), gpu="NVIDIA H200"))


def _printed_rows(rep: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The printed table as {system: {column: cell}}."""
    header, _, *lines = text._rows(rep)
    columns = re.split(r"\s{2,}", header.strip())
    rows = (re.split(r"\s{2,}", line.strip()) for line in lines)
    return {cells[0]: dict(zip(columns, cells, strict=True)) for cells in rows}


def test_targets_only_where_they_were_set(tmp_path: Path) -> None:
    cuda = _fabricated_report(tmp_path, "cuda", "--size-gib", "8")
    judged = {t["target"]: t["ok"] for t in cuda["targets"]}
    assert judged["save / write ceiling"] is False
    assert judged["save speedup over torch"] is True
    assert judged["share of hot load speed that verifying costs"] is False  # 1 - 8/10
    assert cuda["targets_set_for"] == "one H200 GPU machine, 8 GiB GPT-like state"
    printed = text.render_report(cuda)
    assert "targets (set for one H200 GPU machine, 8 GiB GPT-like state):" in printed
    assert "save / write ceiling: 0.5 (want >= 0.95) MISSED" in printed
    assert "verifying checksums cost 20.0%" in printed

    cpu = _fabricated_report(tmp_path, "cpu", "--size-gib", "8")
    assert cpu["targets"] == []
    assert cpu["targets_set_for"] is None
    printed = text.render_report(cpu)
    assert "MISSED" not in printed
    assert "targets (" not in printed
    assert "verifying checksums cost 20.0%" in printed
    small = _fabricated_report(tmp_path, "cuda", "--tensors", "20000", "--tensor-kib", "1")
    assert small["targets"] == []  # set for the GPT-like state, not for many small tensors


def test_two_rank_report_keeps_save_and_load_rss_totals_apart(tmp_path: Path) -> None:
    rep = _fabricated_report(tmp_path, "cuda", "--size-gib", "4", "--ranks", "2")
    rows = _printed_rows(rep)
    assert rows["dcp"]["RSS/proc save"] == "+200 MiB"
    assert rows["dcp"]["RSS/proc load"] == "+50 MiB"
    assert rows["dcp"]["RSS total save"] == "+400 MiB"
    assert rows["dcp"]["RSS total load"] == "+100 MiB"
    assert [t["target"] for t in rep["targets"]] == ["save / write ceiling", "peak RSS growth of save - staging (MiB)"]
    assert rep["targets_set_for"] == report.TARGETS_SET_FOR["ranks"]


def test_touch_brings_a_mapped_load_into_memory(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(257 * 1024 + i) for i in range(8)}  # about 8 MiB, sizes not page multiples
    path = tmp_path / "state.pt"
    torch.save(state, path)
    nbytes = state_nbytes(state)
    loaded = torch.load(path, weights_only=True, mmap=True)
    before = measure.rss_bytes()
    measure.touch(loaded)
    assert measure.rss_bytes() - before >= 0.9 * nbytes  # every page of the mapping was read in
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _present_pages(first: int, count: int) -> list[bool]:
    """Whether each of ``count`` pages from page number ``first`` is mapped (/proc/self/pagemap)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read(count * 8)
    return [bool(int.from_bytes(raw[i : i + 8], "little") >> 63) for i in range(0, len(raw), 8)]


@pytest.mark.parametrize("pages", [1, 3, 40], ids=["in-one-page", "across-pages", "large"])
def test_touch_reads_every_page_of_each_tensor_and_no_other(pages: int) -> None:
    """On fresh anonymous memory (no page is in until it is read, and no neighbour comes with it),
    touch brings in exactly the pages that hold tensors' bytes: small and large tensors alike."""
    page = measure.PAGE
    area = mmap.mmap(-1, 64 * page * (pages + 2))
    base = ctypes.addressof(ctypes.c_char.from_buffer(area)) // page
    state, want = {}, [False] * (len(area) // page)
    for i in range(24):  # every tensor starts mid-page and is followed by a page it must not touch
        at = i * (pages + 2) * page + 100 + 8 * i
        nbytes = (pages - 1) * page + 16 if pages > 1 else 64
        state[f"t{i}"] = torch.frombuffer(area, dtype=torch.float32, offset=at, count=nbytes // 4)
        for p in range(at // page, (at + nbytes - 1) // page + 1):
            want[p] = True
    strided = torch.frombuffer(area, dtype=torch.int64, offset=30 * (pages + 2) * page, count=pages * page // 8)
    state["strided"] = strided[:: max(1, page // 8 // 2)]  # steps of half a page: every page of its reach
    for p in range(30 * (pages + 2), 30 * (pages + 2) + pages):
        want[p] = True
    assert not any(_present_pages(base, len(want)))
    measure.touch(state)
    assert _present_pages(base, len(want)) == want
    del state, strided
    area.close()


BENCH = Path(worker.__file__).parent


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, level) of each import statement of a module of ckptstream.bench."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.module or "", node.level)]
            found += [(f"{node.module}.{a.name}" if node.module else a.name, node.level) for a in node.names]
    return found


def _private(name: str, level: int) -> bool:
    """Whether an import reaches past ckptstream's public API (the library's underscore modules)."""
    if level >= 2:  # from .. import / from ..x import: the library's own modules
        return True
    parts = name.split(".")
    return level == 0 and parts[0] == "ckptstream" and any(p.startswith("_") for p in parts[1:])


# measures the codecs of the compressed format, which no release has yet (docs/compression.md):
# nothing public to call until saves write it
PLANNED = {"compression.py"}


# the ceilings' bare pipelines queue their copies as the engine does, without the interpreter
# lock, one through the engine's own C loop
HARDWARE = {("ceilings.py", "_engine"), ("ceilings.py", "_engine.cudart"), ("ceilings.py", "_engine.hotloop"),
            ("ceilings.py", "_engine.streams")}


def test_the_benchmark_uses_the_public_api_only() -> None:
    found = []
    for path in sorted(p for p in BENCH.glob("*.py") if p.name not in PLANNED):
        found += [f"{path.name}: import {'.' * level}{name}" for name, level in _imports(path)
                  if _private(name, level) and (path.name, name) not in HARDWARE]
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ckptstream"
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.name}:{node.lineno}: ckptstream.{node.attr}")
    assert found == []


def test_the_benchmark_modules_import_one_way() -> None:
    graph = {path.stem: {name.split(".")[0] for name, level in _imports(path) if level == 1 and name}
             for path in BENCH.glob("*.py")}
    graph = {module: {d for d in deps if d in graph and d != module} for module, deps in graph.items()}
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, f"import cycle: {' -> '.join((*stack, module))}"
        if module not in done:
            for dep in graph[module]:
                visit(dep, (*stack, module))
            done.add(module)

    for module in graph:
        visit(module, ())


def run_until(argv: list[str], line: str, sig: signal.Signals = signal.SIGINT) -> tuple[int, str, str]:
    """Run a command in a process group of its own, send the group ``sig`` once ``line`` shows on
    the command's stderr (as Ctrl-C in a terminal does), and wait for it to end. A run that ended
    on its own before the signal came (a busy machine reads the line late) is run again, up to
    three times."""
    for _ in range(3):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        seen: list[str] = []
        assert proc.stderr is not None
        for got in proc.stderr:
            seen.append(got)
            if line in got:
                os.killpg(proc.pid, sig)
                break
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            break
    return proc.returncode, out, "".join(seen) + err


def test_an_interrupted_run_reports_the_systems_it_measured(tmp_path: Path) -> None:
    needs_ctrl_c()  # the run's SIGINT reaches a child that inherits how SIGINT is handled here
    work, out = tmp_path / "work", tmp_path / "bench.json"
    work.mkdir()
    rc, stdout, stderr = run_until([sys.executable, "-m", "ckptstream.cli", "bench", "--quick", "--dir", str(work),
                                    "--json", str(out), "--systems", "ckptstream", "torch", "--hot-runs", "1",
                                    "--variants", "ckptstream", "torch"], "[3/3] torch")
    assert rc == 130, stderr
    data = json.loads(out.read_text())
    assert [row["label"] for row in data["rows"]] == ["ckptstream"]
    assert "torch" not in data["raw"]["systems"]
    assert data["not_run"] == {"torch": "torch skipped: the run was interrupted before it finished"}
    assert re.search(r"\ntorch +not run( +-)+\n", stdout)
    assert data["notes"][-1].startswith("interrupted")
    assert "interrupted: the run stopped after the systems above" in stdout
    assert "ckptstream bench: interrupted; temporary files removed" in stderr
    assert list(work.iterdir()) == []


def test_warm_phases_reuse_the_staging_and_count_it_others_allocate_their_own(tmp_path: Path) -> None:
    """A warm phase (the benchmark's hot loads) reuses the pool the phase before it left, as a
    training process and the peers' own buffers do, and its RSS counts that staging; any other
    phase starts with none held. (A save, since CPU loads stage nothing.)"""
    path = str(tmp_path / "state.safetensors")
    state = {"w": torch.randn(3 * MiB // 4 + 7)}
    group, held = Group("cpu"), []

    def save() -> None:
        held.append(ckptstream.staging_bytes())  # what the phase found in the pool as it began
        ckptstream.save(state, path)

    first, _ = worker.timed_phase(group, save, None, cache.Cold.FADVISE)
    assert held[-1] == 0
    assert first["staging"] > 0
    warm, _ = worker.timed_phase(group, save, None, cache.Cold.FADVISE, warm=True)
    assert held[-1] == first["staging"], "a warm phase did not find the staging the phase before left"
    assert warm["rss"] >= warm["staging"], "the staging a warm phase reused is not in its RSS"
    worker.timed_phase(group, save, None, cache.Cold.FADVISE)
    assert held[-1] == 0, "a phase that is not warm ran with the staging of the phase before it"
    assert torch.equal(ckptstream.load(path)["w"], state["w"])
    ckptstream.release_staging()
