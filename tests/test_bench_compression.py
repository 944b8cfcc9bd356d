"""The compression benchmark at a tiny size: it trains, measures every kind and codec, and each
method gives back the bytes it compressed (measure raises otherwise)."""

from __future__ import annotations

import json

import pytest
import torch

from ckptstream.bench import compression

pytest.importorskip("zstandard")
pytest.importorskip("lz4")


def test_a_tiny_run_reports_every_kind_and_codec(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert compression.main(["--size-mib", "0.125", "--steps", "3", "--chunk-kib", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["kinds"]) == set(compression.KINDS)
    for kind, row in result["kinds"].items():
        names = set(row["methods"])
        assert {f"{c}{g}" for c in compression.CODECS for g in ("", "+grouped")} <= names
        for r in row["methods"].values():
            assert 0 < r["ratio"] <= 1.0
            # a chunk stored as is costs at most the 3% it failed to save
            assert r["ratio"] <= r["codec_ratio"] + 1 - compression.KEEP_BELOW
        assert row["dtype"] == ("bfloat16" if kind == "model" else "float32")
    assert result["loss_last20"] < result["loss_first"]  # it trained
    assert "zstd-1+grouped" in capsys.readouterr().out


def test_measure_catches_a_codec_that_does_not_round_trip():
    parts = compression.chunks({"w": torch.randn(1000)}, 1024)
    bad = compression.Method("bad", lambda b: b.numpy().tobytes(), lambda f, n: torch.zeros(n, dtype=torch.uint8))
    with pytest.raises(AssertionError, match="did not give back"):
        compression.measure(parts, bad)


def test_the_model_state_is_the_bf16_copy_of_the_master_weights():
    trained = compression.train(128 * 1024, 2, seq=16)
    for name, w in trained.state["master"].items():
        assert trained.state["model"][name].dtype == torch.bfloat16
        assert torch.equal(trained.state["model"][name], w.to(torch.bfloat16))
        assert trained.state["exp_avg_sq"][name].min() >= 0


def test_the_entropy_bound_of_constant_and_random_planes():
    const = [torch.full((4096,), 7, dtype=torch.uint8)]
    assert compression.entropy_bound(const, 4) == 0
    noise = [torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)]
    assert 0.99 < compression.entropy_bound(noise, 2) <= 1.0
    half = torch.zeros(1 << 16, dtype=torch.uint8)
    half[1::2] = torch.randint(0, 256, (1 << 15,), dtype=torch.uint8)  # one plane zeros, one random
    assert 0.49 < compression.entropy_bound([half], 2) <= 0.5
