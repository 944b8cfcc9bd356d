"""The checkpoint API on az:// URLs against Azurite: round trips, the manager (its DONE made
last, pruning by prefix), the CLI, the memory of a save, and saves killed with SIGKILL at random
moments: never a torn or partial blob, and the next save goes through without the dead one's
blocks."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli
from ckptstream._storage import register
from ckptstream._storage.azure import AzureStorage
from tests.azure.azutil import Container, MiB, azure, azure_server  # noqa: F401
from tests.azure.child_az_save import two_states
from tests.helpers import assert_same_state, child_env, random_tensor

HERE = Path(__file__).parent


def test_save_load_and_load_into(azure: Container) -> None:
    state = {"model": {"w": random_tensor((512, 1024)), "b": random_tensor(7, torch.bfloat16)},
             "optim": {"m": random_tensor((3 * MiB,))}, "step": 7, "note": None}
    url = azure.url("run/step-1.safetensors")
    with ckptstream.settings(buffer_size=2 * MiB):  # several blocks and a short last one
        ckptstream.save(state, url)
    assert_same_state(ckptstream.load(url), state)
    target = {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(7, dtype=torch.bfloat16)},
              "optim": {"m": torch.zeros(3 * MiB)}, "step": -1, "note": None}
    assert_same_state(ckptstream.load_into(target, url), state)
    with ckptstream.open(url) as reader:
        assert torch.equal(reader.read("model.w"), state["model"]["w"])  # type: ignore[index]


def blobs_made(azure: Container) -> tuple[list[str], Any]:
    """A storage for az:// URLs whose client notes each blob made visible (a Put Blob or a Put
    Block List answered 201), in the order of the answers; and what to register it with."""
    made: list[str] = []

    def answered(response: Any) -> None:
        request, http = response.http_request, response.http_response
        if request.method == "PUT" and http.status_code == 201 and "comp=block&" not in request.url + "&":
            made.append(request.url.split("?")[0].split(f"/{azure.name}/", 1)[1])

    return made, lambda: AzureStorage(raw_response_hook=answered)


def test_the_managers_done_is_made_last_and_pruning_goes_by_prefix(azure: Container) -> None:
    directory = azure.url("run/ckpts")
    azure.put("run/ckpts/step-0000000000011/keep", b"a neighbour's: not a step (13 digits)")
    azure.put("run/ckpts/notes.txt", b"the user's")
    made, storage = blobs_made(azure)
    register("az", storage)
    try:
        states = {step: {"w": random_tensor((3 * MiB,)), "b": random_tensor(10), "step": step} for step in (1, 2, 3)}
        with ckptstream.settings(buffer_size=2 * MiB), ckptstream.CheckpointManager(directory, keep=2) as ckpts:
            for step, state in states.items():
                ckpts.save(state, step, blocking=True)
            assert ckpts.steps() == [2, 3]
            assert_same_state(ckpts.load(2), states[2])
            target = {"w": torch.full((3 * MiB,), float("nan")), "b": torch.zeros(10), "step": -1}
            assert_same_state(ckpts.load_into(target), states[3])
    finally:
        register("az", None)
    steps = [f"run/ckpts/step-00000000000{s}/" for s in (1, 2, 3)]
    assert made == ["run/ckpts/.lock-rank-00000"] + [s + n for s in steps for n in ("state.safetensors", "DONE")]
    assert azure.keys() == ["run/ckpts/notes.txt", "run/ckpts/step-0000000000011/keep",
                            steps[1] + "DONE", steps[1] + "state.safetensors", steps[2] + "DONE",
                            steps[2] + "state.safetensors"]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_verifies_and_lists_az_urls(azure: Container, capsys: pytest.CaptureFixture[str]) -> None:
    url = azure.url("run/a.safetensors")
    ckptstream.save({"w": torch.randn(64, 8), "step": 2}, url)
    status, out, err = run_cli(capsys, "verify", url)
    assert (status, out, err) == (0, f"{url}: OK (1 tensors, checksums verified)\n", "")
    status, out, _ = run_cli(capsys, "inspect", url)
    assert (status, out.startswith(f"{url}: ckptstream 1, 1 tensors")) == (0, True)
    ckptstream.save({"w": torch.randn(64, 8)}, azure.url("run/b.safetensors"))
    status, out, _ = run_cli(capsys, "verify", azure.url("run"))  # the prefix: a folder of checkpoint files
    assert (status, out.count(": OK (")) == (0, 2)
    with ckptstream.CheckpointManager(azure.url("ckpts")) as ckpts:
        ckpts.save({"w": torch.randn(10)}, 5, blocking=True)
    status, out, _ = run_cli(capsys, "verify", azure.url("ckpts"))  # a manager's directory: its steps
    assert (status, out) == (0, f"{azure.url('ckpts/step-000000000005')}: OK (step 5: 1 file, 1 tensors, "
                             "checksums verified)\n")
    raw = bytearray(azure.get("run/a.safetensors"))
    raw[-2] ^= 0x10
    azure.put("run/a.safetensors", bytes(raw))
    status, _, err = run_cli(capsys, "verify", url)
    assert (status, f"{url}: tensor 'w'" in err) == (1, True)
    status, _, err = run_cli(capsys, "verify", azure.url("run/none.safetensors"))
    assert status == 2


def test_memory_of_a_256_mib_save(azure: Container) -> None:
    """Peak RSS over the RSS before the save: the staging buffers, the held-back head and a few
    MiB of client state, not the state's size."""
    out = subprocess.run([sys.executable, str(HERE / "child_az_save.py"), "memory", azure.url("big.safetensors"),
                          "256"], env=child_env(), capture_output=True, text=True, check=True).stdout
    figures = json.loads(out)
    assert figures["staging"] == 8 * 16 * MiB
    assert figures["growth"] <= figures["staging"] + 64 * MiB, figures
    assert len(azure.get("big.safetensors")) > 256 * MiB


def kill_saves(azure: Container, kills: int) -> dict[str, int]:
    """``kills`` saves (alternately of two states) killed with SIGKILL at random moments, each
    followed by the checks: the blob listed alone, and it loads as one of the two states (or
    as the first, before any save landed). Returns how many kills came before the commit (the
    blob unchanged) and after it."""
    url = azure.url("run/ckpt.safetensors")
    both = two_states()
    first = {"w": random_tensor(100)}
    ckptstream.save(first, url)
    seen = {"before": 0, "after": 0}
    current: dict[str, torch.Tensor] = first
    rng = random.Random(31)
    with subprocess.Popen([sys.executable, str(HERE / "child_az_save.py"), "kill", url], env=child_env(),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            # one save not killed: how long one takes here, the span the kills are drawn from
            start = time.monotonic()
            child.stdin.write("go 1\n")
            child.stdin.flush()
            assert child.stdout.readline().startswith("pid ")
            assert child.stdout.readline() == "exit 0\n"
            span = time.monotonic() - start
            current = both[1]
            assert_same_state(ckptstream.load(url), current)
            for k in range(kills):
                child.stdin.write(f"go {k}\n")
                child.stdin.flush()
                pid = int(child.stdout.readline().split()[1])
                time.sleep(rng.uniform(0, span))
                with contextlib.suppress(ProcessLookupError):  # it ended first
                    os.kill(pid, signal.SIGKILL)
                assert child.stdout.readline().startswith("exit ")
                assert azure.keys() == ["run/ckpt.safetensors"]  # nothing partial listed
                loaded = ckptstream.load(url)  # whole: its checksums verified
                if set(loaded) == set(current) and all(torch.equal(loaded[n], current[n]) for n in current):
                    seen["before"] += 1
                else:
                    current = both[k % 2]
                    assert_same_state(loaded, current)
                    seen["after"] += 1
        finally:
            child.stdin.close()
            child.wait(30)
    azure_blob = azure.raw.get_blob_client("run/ckpt.safetensors")
    last = {"w": random_tensor(3 * MiB)}
    with ckptstream.settings(buffer_size=4 * MiB):
        ckptstream.save(last, url)  # the next save goes through; the dead ones' blocks stay out of it
    assert_same_state(ckptstream.load(url), last)
    blocks, left = azure_blob.get_block_list("all")
    assert left == []  # the commit discarded every uncommitted block
    upload_ids = {base64.b64decode(b.id).decode().rsplit("-", 1)[0] for b in blocks}
    assert len(upload_ids) == 1
    assert sum(b.size for b in blocks) == azure_blob.get_blob_properties().size
    return seen


def test_saves_killed_at_random_moments(azure: Container) -> None:
    seen = kill_saves(azure, 8)
    assert sum(seen.values()) == 8


@pytest.mark.slow
def test_thirty_saves_killed_at_random_moments(azure: Container) -> None:
    seen = kill_saves(azure, 30)
    print(f"30 kills: {seen['before']} before the commit, {seen['after']} after it")
    assert sum(seen.values()) == 30
