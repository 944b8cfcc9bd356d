"""StreamCheckpointIO on URLs: the same saves, loads and removals as on local paths, through
the storage a URL's scheme names (here the in-memory storage of the tests, registered for
``mem://``; tests/s3/test_s3_lightning.py runs the same scenarios on S3), a Trainer resumed from
a URL as from a file, and the errors of a URL no storage serves."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import UnsupportedStorageError
from ckptstream.lightning import StreamCheckpointIO
from tests.helpers import child_env, random_tensor
from tests.lightningutil import LIGHTNING_WARNINGS, assert_same, bits, fit, held_saves
from tests.memstore import MemStorage

pytestmark = [*LIGHTNING_WARNINGS, pytest.mark.filterwarnings("ignore:.*The dirpath has changed.*")]

MODES = [None, "device", "lazy", "host"]


@dataclasses.dataclass
class Where:
    """A folder of some storage: ``url(name)`` names an object in it, ``names()`` lists every
    object under it and every unfinished write (an upload, a pending sink), as the store holds
    them."""

    url: Callable[[str], str]
    names: Callable[[], list[str]]


def lightning_state(seed: int) -> dict[str, Any]:
    """What a Lightning checkpoint holds: weights, optimizer moments under int keys, numbers,
    the hyperparameters."""
    g = torch.Generator().manual_seed(seed)
    return {
        "epoch": seed, "global_step": 6 * seed, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.0.weight": torch.randn(420, 64, generator=g), "net.0.bias": random_tensor(420),
                       "emb": random_tensor((33, 7), torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": random_tensor(420)}},
                              "param_groups": [{"lr": 0.003, "betas": (0.9, 0.999), "params": [0]}]}],
        "hyper_parameters": {"hidden": 420, "lr": 0.003, "name": "run"},
    }


def round_trip(io: StreamCheckpointIO, where: Where) -> None:
    """Two checkpoints saved to URLs, loaded back equal, verified, removed one at a time and
    then by their folder; a URL that names nothing is no error to remove and not found to load."""
    first, second = lightning_state(1), lightning_state(2)
    io.save_checkpoint(first, where.url("run/epoch=1.ckpt"), storage_options={"metadata": {"run": "a"}})
    io.save_checkpoint(second, where.url("run/epoch=2.ckpt"))
    assert_same(io.load_checkpoint(where.url("run/epoch=1.ckpt")), first)  # waits for the background saves
    assert_same(io.load_checkpoint(where.url("run/epoch=2.ckpt")), second)
    assert ckptstream.read_metadata(where.url("run/epoch=1.ckpt"))["run"] == "a"
    ckptstream.verify(where.url("run/epoch=2.ckpt"))
    assert where.names() == ["run/epoch=1.ckpt", "run/epoch=2.ckpt"]
    io.remove_checkpoint(where.url("run/epoch=1.ckpt"))
    assert where.names() == ["run/epoch=2.ckpt"]
    io.remove_checkpoint(where.url("run/none.ckpt"))  # as Lightning's: nothing to remove is no error
    with pytest.raises(FileNotFoundError, match=f"Checkpoint file not found: {where.url('run/epoch=1.ckpt')}"):
        io.load_checkpoint(where.url("run/epoch=1.ckpt"))
    io.save_checkpoint(first, where.url("run/sub/last.ckpt"))
    io.remove_checkpoint(where.url("run"))  # a folder: everything in it
    assert where.names() == []
    io.teardown()


def removal_waits_for_the_save(io: StreamCheckpointIO, where: Where, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background save to a URL is held before it writes a byte, until someone waits for it:
    a removal that did not wait would find nothing, and the object would appear afterwards."""
    with held_saves(monkeypatch) as holds:
        io.save_checkpoint(lightning_state(3), where.url("run/held.ckpt"))
        io.remove_checkpoint(where.url("run/held.ckpt"))
        assert holds.released() == [("result", "held.ckpt")]
        assert holds.published() == ["held.ckpt"]
    assert where.names() == []
    io.teardown()


def trainer_resumes_from_a_url(io: StreamCheckpointIO, where: Where, tmp_path: Path) -> None:
    """A run's last checkpoint saved to a URL (``trainer.save_checkpoint``) and a new run
    resumed from it (``fit(ckpt_path=URL)``) give the losses, bit for bit, of the same resume
    from a local file through Lightning's own checkpoint IO."""
    model, run = fit(tmp_path / "theirs", None, epochs=2)
    run.save_checkpoint(tmp_path / "theirs-end.ckpt")
    theirs, _ = fit(tmp_path / "theirs-resumed", None, epochs=4, ckpt_path=str(tmp_path / "theirs-end.ckpt"))

    ours_first, run = fit(tmp_path / "ours", io, epochs=2)
    run.save_checkpoint(where.url("run/end.ckpt"))
    ours, _ = fit(tmp_path / "ours-resumed", io, epochs=4, ckpt_path=where.url("run/end.ckpt"))
    io.teardown()
    assert len(ours.losses) == 12
    assert bits(ours_first.losses) == bits(model.losses)
    assert bits(ours.losses) == bits(theirs.losses)
    assert "run/end.ckpt" in where.names()
    ckptstream.verify(where.url("run/end.ckpt"))


def in_memory(mem: MemStorage) -> Where:
    def names() -> list[str]:
        stored = [n.removeprefix("mem://test/") for n in mem.objects]
        pending = [f"pending:{s.name.removeprefix('mem://test/')}" for s in mem.pending.values()]
        return sorted(stored + pending)

    return Where(lambda name: f"mem://test/{name}", names)


@pytest.mark.parametrize("mode", MODES, ids=[str(m) for m in MODES])
def test_save_load_and_remove_on_a_url(mode: str | None, mem: MemStorage) -> None:
    round_trip(StreamCheckpointIO(mode), in_memory(mem))


def test_a_removal_waits_for_the_save_of_its_url(mem: MemStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    removal_waits_for_the_save(StreamCheckpointIO("device"), in_memory(mem), monkeypatch)


@pytest.mark.parametrize("mode", [None, "lazy"], ids=str)
def test_a_trainer_resumes_from_a_url(mode: str | None, mem: MemStorage, tmp_path: Path) -> None:
    trainer_resumes_from_a_url(StreamCheckpointIO(mode), in_memory(mem), tmp_path)


def test_a_url_no_storage_serves(tmp_path: Path) -> None:
    io = StreamCheckpointIO()
    for call in (lambda url: io.save_checkpoint({"w": torch.randn(2)}, url), io.load_checkpoint,
                 io.remove_checkpoint):
        with pytest.raises(UnsupportedStorageError, match=r"nowhere://b/a\.ckpt: no storage for nowhere:// URLs"):
            call("nowhere://b/a.ckpt")


def test_an_s3_url_without_boto3_says_what_to_install() -> None:
    # a process where boto3 cannot be imported (the s3 extra not installed)
    code = ("import sys; sys.modules['boto3'] = None\n"
            "import torch\n"
            "from ckptstream import UnsupportedStorageError\n"
            "from ckptstream.lightning import StreamCheckpointIO\n"
            "try:\n"
            "    StreamCheckpointIO().save_checkpoint({'w': torch.zeros(2)}, 's3://bucket/run/a.ckpt')\n"
            "except UnsupportedStorageError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("s3://bucket/run/a.ckpt: the storage of s3:// URLs cannot be loaded")
    assert "pip install 'ckptstream[s3]'" in out.stdout
