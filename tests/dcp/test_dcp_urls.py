"""DCP through StreamWriter / StreamReader on URLs: a save and load into a folder of the
in-memory storage of the tests (``mem://``; tests/s3/test_s3_dcp_urls.py runs the same on S3),
named by the writer or by DCP's ``checkpoint_id``, the paths of its files joined by the storage,
the command's verify and inspect of such a folder, and the errors of a missing rank file and
of a URL no storage serves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstream.dcp
from ckptstream import cli
from ckptstream.dcp import StreamReader, StreamWriter
from tests.dcp.dcp_helpers import assert_same, edge_state, fresh_destination, raises_in_dcp, single_process
from tests.memstore import MemStorage


@dataclasses.dataclass
class Folder:
    """A folder of some storage: ``url(name)`` names an object in it; ``remove(name)`` removes
    one behind ckptstream's back; ``names(prefix)`` lists the objects under a prefix."""

    url: Callable[[str], str]
    remove: Callable[[str], None]
    names: Callable[[str], list[str]]


def save_and_load(folder: Folder, capsys: pytest.CaptureFixture[str]) -> None:
    state = edge_state()
    url = folder.url("run/step-7")
    single_process(dcp.save, state, storage_writer=StreamWriter(url))
    assert folder.names("run/step-7/") == [".metadata", "rank-00000.safetensors"]
    assert ckptstream.dcp.checkpoint_files(url) == [f"{url}/.metadata", f"{url}/rank-00000.safetensors"]
    loaded = fresh_destination(state)
    single_process(dcp.load, loaded, storage_reader=StreamReader(url))
    assert_same(loaded, state)
    # DCP's checkpoint_id names the folder in place of the writer's and the reader's own
    other = folder.url("run/step-8")
    single_process(dcp.save, state, checkpoint_id=other, storage_writer=StreamWriter(folder.url("unused")))
    loaded = fresh_destination(state)
    single_process(dcp.load, loaded, checkpoint_id=other, storage_reader=StreamReader(folder.url("unused")))
    assert_same(loaded, state)
    assert folder.names("unused/") == []
    # the command reads such a folder as it reads a local one
    assert cli.main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{url}: OK"), out
    assert cli.main(["inspect", url]) == 0
    assert "rank-00000.safetensors" in capsys.readouterr().out
    # a rank file gone: the load names its object
    folder.remove("run/step-7/rank-00000.safetensors")
    raises_in_dcp(FileNotFoundError, f"{url}/rank-00000.safetensors", single_process, dcp.load,
                  fresh_destination(state), storage_reader=StreamReader(url))
    assert cli.main(["verify", url]) != 0
    assert f"{url}/rank-00000.safetensors" in capsys.readouterr().err


def in_memory(mem: MemStorage) -> Folder:
    def names(prefix: str) -> list[str]:
        return sorted(n.removeprefix(f"mem://test/{prefix}") for n in mem.objects if n.startswith(f"mem://test/{prefix}"))

    return Folder(lambda name: f"mem://test/{name}", lambda name: mem.remove(f"mem://test/{name}"), names)


def test_save_and_load_in_a_url_folder(mem: MemStorage, capsys: pytest.CaptureFixture[str]) -> None:
    save_and_load(in_memory(mem), capsys)


def test_the_checkpoint_ids_it_takes(mem: MemStorage, tmp_path: Any) -> None:
    for kind in (StreamWriter, StreamReader):
        assert kind.validate_checkpoint_id("mem://test/run")
        assert kind.validate_checkpoint_id(tmp_path / "run")
        assert kind.validate_checkpoint_id("s3://bucket/run")  # built in (its client is imported on first use)
        assert not kind.validate_checkpoint_id("nowhere://bucket/run")


def test_a_url_no_storage_serves(mem: MemStorage) -> None:
    for kind in (StreamWriter, StreamReader):
        with pytest.raises(ckptstream.UnsupportedStorageError, match="nowhere://b/run: no storage for nowhere:// URLs"):
            kind("nowhere://b/run")
        with pytest.raises(ckptstream.UnsupportedStorageError, match="nowhere://b/run: no storage for nowhere:// URLs"):
            kind("mem://test/run").reset("nowhere://b/run")  # DCP's checkpoint_id, before it plans


def test_two_gloo_ranks_in_a_url_folder(mem: MemStorage) -> None:
    # the ranks are processes: they share the in-memory storage through dicts this process serves
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from tests.dcp.sharedmem import Server
    from tests.helpers import child_env

    server = Server()
    try:
        with socket.socket() as sock:  # a free port for the group's store, on this machine only
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = "mem://test/run/dcp-2"
        host, shared_port = server.address
        ranks = []
        for rank in range(2):
            env = {**child_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
            ranks.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("child_mem_rank.py")), url, host, str(shared_port),
                 server.key.hex()], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=240)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], outputs
        assert sorted(n.removeprefix(f"{url}/") for n in server.objects) == [
            ".metadata", "rank-00000.safetensors", "rank-00001.safetensors"]
    finally:
        server.stop()
    # the two ranks' checkpoint, read back in one process from a storage holding the same bytes
    from tests.s3.child_dcp_rank import state

    mem.objects.update(server.objects)
    want = {**state(0), **state(1)}
    loaded = {k: torch.full_like(v, -1) for k, v in want.items()}
    single_process(dcp.load, loaded, storage_reader=StreamReader(url))
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key
