"""The checkpoint API on gs:// URLs against gcp-storage-emulator: save / load / open / load_into
/ save_async round trips, the requests of a save and a load, the memory of a save, the manager
with its DONE made last and pruning by prefix, a corrupted object caught by its CRC-32C, the
CLI, and errors through the API naming the URL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli
from ckptstream._storage.gcs import GCSClient
from tests.gcs.gcsutil import Bucket, MiB, gcs, gcs_server  # noqa: F401
from tests.gcs.reqcount import counted
from tests.helpers import assert_same_state, child_env, random_tensor

HERE = Path(__file__).parent


def test_save_load_round_trip(gcs: Bucket) -> None:
    w = random_tensor((512, 1024))
    state: dict[str, Any] = {"model": {"w": w, "tied": w, "b": random_tensor(33, torch.bfloat16)},
                             "optim": {"exp_avg": random_tensor((3 * MiB,))}, "step": 7, "note": None}
    url = gcs.url("run/step-1.safetensors")
    with ckptstream.settings(buffer_size=5 * MiB):  # several parts and a short last one
        ckptstream.save(state, url)
    assert gcs.all_keys() == ["run/step-1.safetensors"]
    back = ckptstream.load(url)
    assert_same_state(back, state)
    assert back["model"]["w"].data_ptr() == back["model"]["tied"].data_ptr()
    ckptstream.verify(url)
    with ckptstream.open(url) as reader:
        assert torch.equal(reader.get_slice("optim.exp_avg")[100:200], state["optim"]["exp_avg"][100:200])
    into: dict[str, Any] = {"model": {"w": torch.zeros(512, 1024), "tied": torch.zeros(512, 1024),
                                      "b": torch.zeros(33, dtype=torch.bfloat16)},
                            "optim": {"exp_avg": torch.full((3 * MiB,), float("nan"))}, "step": 0, "note": None}
    ckptstream.load_into(into, url)  # (tensors filled in place; the other values stay the caller's)
    assert_same_state(into["model"], state["model"])
    assert torch.equal(into["optim"]["exp_avg"], state["optim"]["exp_avg"])


def test_save_async(gcs: Bucket) -> None:
    state = {"w": random_tensor((2 * MiB,))}
    expected = state["w"].clone()
    ckptstream.save_async(state, gcs.url("k.safetensors")).result()
    state["w"].zero_()
    assert torch.equal(ckptstream.load(gcs.url("k.safetensors"))["w"], expected)


def test_the_requests_of_a_save_and_a_load(gcs: Bucket) -> None:
    """What docs/object-stores.md says a save and a load cost on GCS: a save of B bytes one
    listing (the key is not a folder), one of the key's parts (uploads of dead writers), the
    parts (ceil((B - E) / S) + 1), one compose, then one listing and one batch request that remove
    the parts; a load one GET that opens the object and brings its header, then one per chunk."""
    url = gcs.url("k.safetensors")
    with ckptstream.settings(buffer_size=5 * MiB), counted() as sent:  # S = E = 5 MiB
        ckptstream.save({"w": random_tensor((3 * MiB,)), "b": random_tensor(7)}, url)  # B: 12 MiB + 28 + header
        parts = -(-(len(gcs.get("k.safetensors")) - 5 * MiB) // (5 * MiB)) + 1
        assert sent.pop("GET bucket", 0) <= 1  # the library's own look at a bucket's metadata, once, in the background
        assert dict(sent) == {"list": 3, "upload": parts, "compose": 1, "batch": 1}
        sent.clear()
        ckptstream.load(url)
        assert dict(sent) == {"download": 1 + 3}  # the data: 12 MiB + 28 bytes in chunks of 5 MiB


def test_memory_of_a_256_mib_save(gcs: Bucket) -> None:
    """Peak RSS over the RSS before the save: the staging buffers, the held-back head and a few
    MiB of client state, not the state's size."""
    out = subprocess.run([sys.executable, str(HERE / "child_gcs_save.py"), "memory", gcs.url("big.safetensors"),
                          "256"], env=child_env(), capture_output=True, text=True, check=True).stdout
    figures = json.loads(out)
    assert figures["staging"] == 8 * 16 * MiB
    assert figures["growth"] <= figures["staging"] + 5 * MiB + 32 * MiB, figures
    assert len(gcs.get("big.safetensors")) > 256 * MiB


def objects_made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the objects the adapter makes visible from now on (each single upload to a
    key and each final compose, once answered), in the order the answers came."""
    made: list[str] = []
    put, complete = GCSClient.put, GCSClient.complete_upload

    def put_noted(self: GCSClient, url: Any, *args: Any) -> None:
        put(self, url, *args)
        made.append(url.key)

    def complete_noted(self: GCSClient, url: Any, *args: Any) -> None:
        complete(self, url, *args)
        made.append(url.key)

    monkeypatch.setattr(GCSClient, "put", put_noted)
    monkeypatch.setattr(GCSClient, "complete_upload", complete_noted)
    return made


def test_a_checkpoint_manager_on_gcs(gcs: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """Save, list, keep, delete, load and load_into with the manager's directory a prefix; each
    step's DONE is made only after its state object is complete; pruning goes by prefix."""
    directory = gcs.url("run/ckpts")
    gcs.put("run/ckpts/step-0000000000011/keep", b"a neighbour's: not a step (13 digits)")
    states = {step: {"w": random_tensor((3 * MiB,)), "b": random_tensor(10), "step": step} for step in (1, 2, 3)}
    made = objects_made(monkeypatch)
    with ckptstream.settings(buffer_size=5 * MiB), ckptstream.CheckpointManager(directory, keep=2) as ckpts:
        for step, state in states.items():
            ckpts.save(state, step, blocking=True)
        assert ckpts.steps() == [2, 3]
        assert_same_state(ckpts.load(2), states[2])
        target = {"w": torch.full((3 * MiB,), float("nan")), "b": torch.zeros(10), "step": -1}
        assert_same_state(ckpts.load_into(target), states[3])
        ckpts.delete(2)
        assert ckpts.steps() == [3]
    steps = [f"run/ckpts/step-00000000000{s}/" for s in (1, 2, 3)]
    assert made == ["run/ckpts/.lock-rank-00000"] + [s + n for s in steps for n in ("state.safetensors", "DONE")]
    assert gcs.all_keys() == ["run/ckpts/step-0000000000011/keep", steps[2] + "DONE", steps[2] + "state.safetensors"]


def test_a_corrupted_object_fails_its_load_naming_the_url(gcs: Bucket) -> None:
    state = {"a": random_tensor(1000), "z": random_tensor((2 * MiB,))}
    url = gcs.url("run/k.safetensors")
    ckptstream.save(state, url)
    data = bytearray(gcs.get("run/k.safetensors"))
    data[-5] ^= 0x10  # in z's data: the object's last tensor
    gcs.put("run/k.safetensors", bytes(data))
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"gs://.*/run/k\.safetensors"):
        ckptstream.load(url)
    with ckptstream.open(url) as reader:
        assert torch.equal(reader.read("a"), state["a"])  # the others are intact
        with pytest.raises(ckptstream.CorruptCheckpointError, match=r"gs://.*/run/k\.safetensors.*'z'"):
            reader.read("z")


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_on_gs_urls(gcs: Bucket, capsys: pytest.CaptureFixture[str]) -> None:
    url = gcs.url("run/a.safetensors")
    ckptstream.save({"w": torch.randn(64, 8), "step": 2}, url)
    assert run_cli(capsys, "verify", url) == (0, f"{url}: OK (1 tensors, checksums verified)\n", "")
    status, out, _ = run_cli(capsys, "inspect", url)
    assert status == 0
    assert out.startswith(f"{url}: ckptstream 1, 1 tensors")
    ckptstream.save({"w": torch.randn(64, 8)}, gcs.url("run/b.safetensors"))
    status, out, _ = run_cli(capsys, "verify", gcs.url("run"))  # the prefix: a folder of checkpoint files
    assert (status, out.count(": OK (")) == (0, 2)
    raw = bytearray(gcs.get("run/a.safetensors"))
    raw[-2] ^= 0x10
    gcs.put("run/a.safetensors", bytes(raw))
    status, _, err = run_cli(capsys, "verify", url)
    assert status == 1
    assert f"{url}: tensor 'w'" in err


def test_errors_name_the_url_before_any_work(gcs: Bucket) -> None:
    with pytest.raises(ckptstream.BucketNotFoundError, match="gs://no-such-bucket-here/k"):
        ckptstream.save({"w": random_tensor(3)}, "gs://no-such-bucket-here/k")
    with pytest.raises(FileNotFoundError, match="no such object"):
        ckptstream.load(gcs.url("absent.safetensors"))
    ckptstream.save({"w": random_tensor(3)}, gcs.url("k.safetensors"))
    with pytest.raises(ckptstream.UnsupportedStorageError, match=r"gs://.*k\.safetensors"):
        ckptstream.load(gcs.url("k.safetensors"), mmap=True)
