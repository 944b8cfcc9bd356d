"""The checkpoint API on s3:// URLs against a real S3 server: save / load / open / load_into /
save_async round trips (CPU, and CUDA on a GPU machine), ranged reads only, a save killed
mid-upload, the memory of a 256 MiB save, the manager's DONE made last and its pruning by
prefix, a corrupted object caught by its CRC-32C, DCP, and errors surfacing through the API."""

from __future__ import annotations

import collections
import json
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._format.header import DTYPE_NAMES
from tests.helpers import EDGE_CASES, assert_same_state, child_env, random_tensor
from tests.s3.s3util import Bucket, MiB, boto, s3, s3_server  # noqa: F401

HERE = Path(__file__).parent


def nested_state(device: torch.device | str) -> dict[str, object]:
    edge = {c.name: c.source(device) for c in EDGE_CASES if c.dtype in DTYPE_NAMES}  # those safetensors names
    w = random_tensor((512, 1024), device=device)  # 2 MiB
    return {"model": {"w": w, "tied": w, "edges": edge}, "optim": {"state": {0: {"exp_avg": random_tensor(
        (3 * MiB,), device=device)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}, "step": 7, "note": None}


def test_save_load_round_trip(s3: Bucket, device: torch.device) -> None:
    state = nested_state(device)
    url = s3.url("run/step-1.safetensors")
    with ckptstream.settings(buffer_size=5 * MiB):  # several parts and a short last one
        ckptstream.save(state, url)
    assert s3.keys() == ["run/step-1.safetensors"]
    assert s3.uploads() == []
    back = ckptstream.load(url, device=device)
    assert_same_state(back, state, device=device.type)
    assert back["model"]["w"].data_ptr() == back["model"]["tied"].data_ptr()  # shared storage comes back shared
    ckptstream.verify(url)


def test_open_reads_only_the_bytes_asked_for(s3: Bucket) -> None:
    big = {"a": random_tensor((8 * MiB // 4,)), "b": random_tensor((8 * MiB // 4,)), "c": random_tensor(1000)}
    url = s3.url("k.safetensors")
    ckptstream.save(big, url)
    ranges: list[str] = []
    boto().meta.events.register("before-send.s3.GetObject",
                                           lambda request, **kw: ranges.append(request.headers["Range"].decode()))
    with ckptstream.open(url) as reader:
        assert torch.equal(reader.read("c"), big["c"])
        rows = reader.get_slice("b")[100:200]
    assert torch.equal(rows, big["b"][100:200])
    asked = sum(int(hi) - int(lo) + 1 for lo, hi in (r.removeprefix("bytes=").split("-") for r in ranges))
    assert asked < 2 * MiB  # the header, c, and 100 floats of b: not the 16 MiB of a and b


def test_the_requests_of_a_save_and_a_load(s3: Bucket) -> None:
    """What docs/object-stores.md says a save and a load cost: a save of B bytes one LIST (the
    key is not a folder), one listing of the key's uploads, then the upload (ceil((B - E) / S) + 1
    parts); a load one GET that opens the object and brings its header, then one per chunk."""
    sent: collections.Counter[str] = collections.Counter()
    boto().meta.events.register("before-send.s3",
                                           lambda event_name, **kw: sent.update([event_name.rsplit(".", 1)[1]]))
    url = s3.url("k.safetensors")
    with ckptstream.settings(buffer_size=5 * MiB):  # S = E = 5 MiB
        ckptstream.save({"w": random_tensor((3 * MiB,)), "b": random_tensor(7)}, url)  # B: 12 MiB + 28 + header
        assert sent == {"ListObjectsV2": 1, "ListMultipartUploads": 1, "CreateMultipartUpload": 1,
                        "UploadPart": -(-(len(s3.get("k.safetensors")) - 5 * MiB) // (5 * MiB)) + 1,
                        "CompleteMultipartUpload": 1}
        sent.clear()
        ckptstream.load(url)
        assert sent == {"GetObject": 1 + 3}  # the data: 12 MiB + 28 bytes in chunks of 5 MiB


def test_load_into(s3: Bucket, device: torch.device) -> None:
    state: dict[str, Any] = {"w": random_tensor((300, 700), device=device),
                             "v": random_tensor(5, torch.bfloat16, device=device), "step": 3}
    url = s3.url("k.safetensors")
    ckptstream.save(state, url)
    into: dict[str, Any] = {"w": torch.full((300, 700), float("nan"), device=device),
                            "v": torch.zeros(5, dtype=torch.bfloat16, device=device), "step": 0}
    ckptstream.load_into(into, url)
    assert torch.equal(into["w"], state["w"])
    assert torch.equal(into["v"], state["v"])
    assert into["w"].device.type == device.type


def test_save_async(s3: Bucket, device: torch.device) -> None:
    state = {"w": random_tensor((2 * MiB,), device=device)}
    expected = state["w"].clone()
    handle = ckptstream.save_async(state, s3.url("k.safetensors"), mode="device")
    handle.result()
    state["w"].zero_()  # the save holds its own copy once done
    back = ckptstream.load(s3.url("k.safetensors"), device=device)["w"]
    assert back.device.type == device.type
    assert torch.equal(back, expected)


def test_a_save_killed_mid_upload_leaves_the_old_object(s3: Bucket) -> None:
    old = {"w": random_tensor(100)}
    url = s3.url("run/ckpt.safetensors")
    ckptstream.save(old, url)
    env = child_env()
    with subprocess.Popen([sys.executable, str(HERE / "child_s3_save.py"), "kill", url], env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "parts up\n"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    assert s3.keys() == ["run/ckpt.safetensors"]  # nothing new listed
    assert torch.equal(ckptstream.load(url)["w"], old["w"])
    assert len(s3.uploads()) == 1
    new = {"w": random_tensor(200)}
    ckptstream.save(new, url)  # aborts the dead writer's upload first
    assert s3.uploads() == []
    assert torch.equal(ckptstream.load(url)["w"], new["w"])


def test_memory_of_a_256_mib_save(s3: Bucket) -> None:
    """Peak RSS over the RSS before the save: the staging buffers, the held-back head and a few
    MiB of client state, not the state's size."""
    env = child_env()
    out = subprocess.run([sys.executable, str(HERE / "child_s3_save.py"), "memory", s3.url("big.safetensors"), "256"],
                         env=env, capture_output=True, text=True, check=True).stdout
    figures = json.loads(out)
    assert figures["staging"] == 8 * 16 * MiB
    assert figures["growth"] <= figures["staging"] + 5 * MiB + 32 * MiB, figures
    assert len(s3.get("big.safetensors")) > 256 * MiB


def test_a_checkpoint_manager_on_s3(s3: Bucket) -> None:
    """Save, list, keep, delete, load and load_into with the manager's directory a prefix; an
    unfinished upload of a step's file is aborted when the step goes."""
    directory = s3.url("run/ckpts")
    states = {step: {"w": random_tensor((1000, 33)), "step": step} for step in (1, 2, 3)}
    with ckptstream.CheckpointManager(directory, keep=2) as ckpts:
        for step, state in states.items():
            ckpts.save(state, step, blocking=True)
        assert ckpts.steps() == [2, 3]
        # and the writer's record, while it writes (removed when it closes)
        assert sorted(s3.keys()) == ["run/ckpts/.lock-rank-00000"] + [f"run/ckpts/step-00000000000{s}/{n}"
                                                                      for s in (2, 3)
                                                                      for n in ("DONE", "state.safetensors")]
        assert_same_state(ckpts.load(2), states[2])
        target = {"w": torch.full((1000, 33), float("nan")), "step": -1}
        assert_same_state(ckpts.load_into(target), states[3])
        s3.raw.create_multipart_upload(Bucket=s3.name, Key="run/ckpts/step-000000000002/DONE")  # a dead writer's
        ckpts.delete(2)
        assert ckpts.steps() == [3]
    assert sorted(s3.keys()) == ["run/ckpts/step-000000000003/DONE", "run/ckpts/step-000000000003/state.safetensors"]
    assert s3.uploads() == []


def objects_made() -> list[str]:
    """The keys of the objects the library's client makes visible from now on (each PUT and each
    completed multipart upload, once answered), in the order the answers came."""
    made: list[str] = []
    events = boto().meta.events

    def remember(params: dict[str, Any], context: dict[str, Any], **kw: Any) -> None:
        context["test_key"] = params.get("Key")

    def answered(http_response: Any, context: dict[str, Any], **kw: Any) -> None:
        if http_response.status_code == 200:
            made.append(context["test_key"])

    for op in ("PutObject", "CompleteMultipartUpload"):
        events.register(f"before-parameter-build.s3.{op}", remember)
        events.register(f"after-call.s3.{op}", answered)
    return made


def test_the_managers_done_is_made_last_and_pruning_goes_by_prefix(s3: Bucket) -> None:
    """Each step's DONE becomes visible only after its state object is complete; pruning a step
    removes every object under its prefix, and nothing of a neighbour whose name it begins."""
    directory = s3.url("run/ckpts")
    s3.put("run/ckpts/step-0000000000011/keep", b"a neighbour's: not a step (13 digits)")
    s3.put("run/ckpts/notes.txt", b"the user's")
    made = objects_made()
    with ckptstream.settings(buffer_size=5 * MiB), ckptstream.CheckpointManager(directory, keep=1) as ckpts:
        for step in (1, 2):
            ckpts.save({"w": random_tensor((3 * MiB,)), "b": random_tensor(10), "step": step}, step, blocking=True)
    steps = [f"run/ckpts/step-00000000000{s}/" for s in (1, 2)]
    assert made == ["run/ckpts/.lock-rank-00000", steps[0] + "state.safetensors", steps[0] + "DONE",
                    steps[1] + "state.safetensors", steps[1] + "DONE"]  # the writer's record first
    assert s3.keys() == ["run/ckpts/notes.txt", "run/ckpts/step-0000000000011/keep", steps[1] + "DONE",
                         steps[1] + "state.safetensors"]
    assert s3.uploads() == []


def test_a_corrupted_object_fails_its_load_naming_the_url(s3: Bucket) -> None:
    """A byte changed in the store (after the save's own checks) is caught by the header's
    CRC-32C: load, load_into and a reader's read fail with CorruptCheckpointError naming the URL."""
    state = {"a": random_tensor(1000), "z": random_tensor((2 * MiB,))}
    url = s3.url("run/k.safetensors")
    ckptstream.save(state, url)
    data = bytearray(s3.get("run/k.safetensors"))
    data[-5] ^= 0x10  # in z's data: the object's last tensor
    s3.put("run/k.safetensors", bytes(data))
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"s3://.*/run/k\.safetensors"):
        ckptstream.load(url)
    into = {"a": torch.zeros(1000), "z": torch.zeros(2 * MiB)}
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"s3://.*/run/k\.safetensors"):
        ckptstream.load_into(into, url)
    with ckptstream.open(url) as reader:
        assert torch.equal(reader.read("a"), state["a"])  # the others are intact
        with pytest.raises(ckptstream.CorruptCheckpointError, match=r"s3://.*/run/k\.safetensors.*'z'"):
            reader.read("z")
    s3.put("run/k.safetensors", bytes(data[:-100]))  # cut short
    with pytest.raises(ckptstream.CorruptCheckpointError, match=r"s3://.*/run/k\.safetensors.*truncated"):
        ckptstream.load(url)


def test_dcp_on_s3(s3: Bucket) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptstream.dcp

    sd = {"a": random_tensor(1000), "b": random_tensor((30, 40), torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own warning: one process, no process group
        dcp.save(sd, storage_writer=ckptstream.dcp.StreamWriter(s3.url("dcp-1")))
        out = {"a": torch.zeros(1000), "b": torch.zeros(30, 40, dtype=torch.bfloat16)}
        dcp.load(out, storage_reader=ckptstream.dcp.StreamReader(s3.url("dcp-1")))
    assert torch.equal(out["a"], sd["a"])
    assert torch.equal(out["b"], sd["b"])
    assert ".metadata" in [k.rsplit("/", 1)[1] for k in s3.keys("dcp-1/")]


def test_dcp_with_two_gloo_ranks(s3: Bucket) -> None:
    with socket.socket() as sock:  # a free port for the group's store, on this machine only
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = {**child_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
        ranks.append(subprocess.Popen([sys.executable, str(HERE / "child_dcp_rank.py"), s3.url("run/dcp-5")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    names = [k.removeprefix("run/dcp-5/") for k in s3.keys("run/dcp-5/")]
    assert ".metadata" in names
    assert len([n for n in names if n.endswith(".safetensors")]) == 2, names  # one object per rank
    assert s3.uploads() == []


def test_errors_name_the_url_before_any_work(s3: Bucket) -> None:
    with pytest.raises(ckptstream.BucketNotFoundError, match="s3://no-such-bucket/k"):
        ckptstream.save({"w": random_tensor(3)}, "s3://no-such-bucket/k")
    with pytest.raises(FileNotFoundError, match="no such object"):
        ckptstream.load(s3.url("absent.safetensors"))
    ckptstream.save({"w": random_tensor(3)}, s3.url("k.safetensors"))
    with pytest.raises(ckptstream.UnsupportedStorageError, match=r"s3://.*k\.safetensors"):
        ckptstream.load(s3.url("k.safetensors"), mmap=True)  # an object cannot be mapped
    assert s3.uploads() == []
