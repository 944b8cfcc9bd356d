"""The ceilings' sweep: which mechanisms it tries, that each reads or writes every byte once, and
that the report takes the best of them (and the slower of the hot read and the pinned copy for
a load into a GPU)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from ckptstream.bench import ceilings, report
from ckptstream.bench.ceilings import Probe

MiB = 1 << 20


@pytest.mark.parametrize("how", ["direct", "buffered", "ranges"])
@pytest.mark.parametrize(("nbytes", "threads", "block"), [(64 * MiB, 4, 8 * MiB), (9 * MiB + 4096, 3, 2 * MiB),
                                                          (5 * MiB, 8, MiB), (MiB, 1, 64 * MiB)])
def test_each_schedule_covers_every_block_once_in_file_order_per_thread(
        how: str, nbytes: int, threads: int, block: int) -> None:
    schedule = ceilings._schedule(nbytes, Probe(how, threads, block), block)
    assert len(schedule) == threads
    flat = sorted(b for per in schedule for b in per)
    assert flat == ceilings._blocks(nbytes, block)
    for per in schedule:
        assert per == sorted(per)
        if how == "ranges" and per:  # one contiguous range per thread
            assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(per))


def test_the_sweep_spans_queue_depths_blocks_and_mechanisms() -> None:
    write = ceilings.probes("write", [1, 4, 16, 64], [16], 8 << 30)
    read = ceilings.probes("read", [1, 4, 16, 64], [16], 8 << 30)
    hot = ceilings.probes("hot", [1, 4, 16, 64], [8, 16], 8 << 30)
    assert {p.how for p in write} == {"direct", "buffered"}
    assert {p.how for p in read} == {"direct", "ranges"}
    assert {p.how for p in hot} == {"buffered", "ranges"}
    assert {p.threads for p in read} == {1, 4, 16, 64}
    assert {p.block for p in read if p.how == "direct"} == {64 * MiB, 8 * MiB, 2 * MiB, MiB}
    for sweep in (write, read, hot):
        assert len({p.label for p in sweep}) == len(sweep)  # a label names one probe of its sweep
    small = ceilings.probes("read", [1, 4, 16, 64], [16], 4 * MiB)
    assert small
    assert all(p.threads * p.block <= 4 * MiB and p.block <= ceilings.block_for(4 * MiB) for p in small)


@pytest.mark.parametrize("how", ["direct", "buffered", "ranges"])
def test_each_mechanism_reads_and_writes_the_whole_file(tmp_path: Path, how: str) -> None:
    path = str(tmp_path / "raw")
    nbytes = 6 * MiB + 8192
    seconds, _ = ceilings.raw_write(path, nbytes, Probe("buffered" if how == "ranges" else how, 3, 2 * MiB))
    assert seconds > 0
    assert os.path.getsize(path) == nbytes
    with open(path, "rb") as f:
        data = f.read()
    assert len(set(data[: 1 << 16])) > 200  # random bytes, not a hole
    assert ceilings.raw_read(path, nbytes, Probe(how, 3, MiB)) > 0


def _result(write: dict[str, float], hot: dict[str, float], h2d: float | None) -> dict:
    out = {"bytes": 10**9, "block": 64 * MiB, "resident": [0.0], "memory": 30.0,
           "write": {k: [1 / v] for k, v in write.items()}, "read": {"direct 4x64MiB": [1.0]},
           "hot": {k: [1 / v] for k, v in hot.items()}}
    if h2d is not None:
        out.update(copy={"d2h": h2d, "h2d": h2d}, gpu="a GPU", gpus=1)
    return out


def test_the_report_takes_the_best_probe_and_says_which() -> None:
    figures = report.ceiling_figures([_result({"direct 1x64MiB": 2.0, "direct 16x8MiB": 2.5, "buffered 4x16MiB": 0.8},
                                              {"buffered 8x8MiB": 30.0, "ranges 16x2MiB": 60.0}, None)])
    assert figures["write"]["how"] == "direct 16x8MiB"
    assert figures["write"]["gbps"] == pytest.approx(2.5)
    assert figures["hot"]["how"] == "ranges 16x2MiB"
    assert figures["memory"] == {"gbps": 30.0}
    assert "hot_gpu" not in figures  # no GPU


@pytest.mark.parametrize(("h2d", "how"), [(50.0, "pinned H2D"), (70.0, "ranges 16x2MiB")])
def test_a_hot_load_into_a_gpu_is_held_to_the_slower_of_the_page_cache_and_the_copy(h2d: float, how: str) -> None:
    figures = report.ceiling_figures([_result({"direct 1x64MiB": 2.0}, {"ranges 16x2MiB": 60.0}, h2d)])
    assert figures["hot_gpu"]["how"] == how
    assert figures["hot_gpu"]["gbps"] == pytest.approx(min(h2d, 60.0))


def test_a_hot_load_into_a_gpu_is_held_to_the_best_pipeline_where_one_was_measured() -> None:
    result = _result({"direct 1x64MiB": 2.0}, {"ranges 16x2MiB": 60.0}, 55.0)
    result["pipeline"] = {"pinned 8x16MiB": [1 / 24.0], "pinned 16x64MiB": [1 / 31.0]}
    figures = report.ceiling_figures([result])
    assert figures["hot_gpu"]["how"] == "pinned 16x64MiB"
    assert figures["hot_gpu"]["gbps"] == pytest.approx(31.0)
    assert "pipeline" not in figures


def test_the_pipeline_sweep_tries_the_engines_threads_and_deep_buffers() -> None:
    assert ceilings.pipeline_probes([], 8 << 30) == []
    from ckptstream._engine import cudart, hotloop

    native = hotloop.LIBRARY is not None and cudart.native_calls() is not None  # the C loop's probe too
    labels = [p.label for p in ceilings.pipeline_probes([16], 8 << 30)]
    assert labels == ["pinned 8x16MiB", "pinned 16x16MiB", "pinned 16x64MiB", "pinned-ranges 16x8MiB",
                      "pinned-ranges 16x16MiB", *(["native-ranges 16x8MiB"] if native else [])]
    assert [p.label for p in ceilings.pipeline_probes([1, 4], 8 << 30)] == [
        "pinned 1x16MiB", "pinned 4x16MiB", "pinned 4x64MiB", "pinned-ranges 4x8MiB", "pinned-ranges 4x16MiB",
        *(["native-ranges 4x8MiB"] if native else [])]
    small = ceilings.pipeline_probes([16], 32 * MiB)
    assert small
    assert all(p.threads * p.block <= 32 * MiB for p in small[1:])


@pytest.mark.gpu
@pytest.mark.parametrize(("how", "threads", "block"), [("pinned", 3, MiB), ("pinned", 16, 2 * MiB),
                                                       ("pinned-ranges", 3, MiB), ("pinned-ranges", 16, 2 * MiB),
                                                       ("native-ranges", 3, MiB), ("native-ranges", 16, 2 * MiB)])
def test_the_pipeline_moves_every_byte_of_the_file_into_the_device(tmp_path: Path, how: str, threads: int,
                                                                   block: int) -> None:
    import torch

    from ckptstream._engine import hotloop

    if how == "native-ranges" and hotloop.LIBRARY is None:
        pytest.skip("the native loop is not built (setup.py)")
    nbytes = 7 * MiB + 4096 * 3  # a short last block
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "raw"
    path.write_bytes(data.numpy().tobytes())
    dst = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    assert ceilings.pipeline_read(str(path), nbytes, Probe(how, threads, block), "cuda", dst=dst) > 0
    assert torch.equal(dst.cpu(), data)
