"""An export killed for real (SIGKILL of a child process) leaves no folder that transformers
takes as complete but the earlier export: killed while the tensors stream, the earlier export in
OUT is still there, whole; killed while the files are renamed in, it is still there, whole, where
the new shards have names of their own, and there is no index where they take the names of its
shards. A later export then succeeds and leaves no temp behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

pytest.importorskip("transformers")

import ckptstream
from tests.hfutil import assert_reloads, check_folder, tiny_config, tiny_gpt2, trained_state

HERE = Path(__file__).resolve().parent


def kill_mid_export(src: Path, out: Path, point: str) -> None:
    env = child_env()
    proc = subprocess.Popen([sys.executable, str(HERE / "child_export.py"), "kill", str(src), str(out), point],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child is at the point asked for, and waits there
        assert line == "ready\n", line + proc.stderr.read() if proc.stderr else line
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("earlier", ["60KB", "40KB"])  # shards of other names than the new ones; of the same
@pytest.mark.parametrize("point", ["stream", "publish"])
def test_a_killed_export_never_looks_complete(tmp_path: Path, point: str, earlier: str) -> None:
    model = tiny_gpt2()
    src = tmp_path / "state.safetensors"
    ckptstream.save(trained_state(model), src)
    out = tmp_path / "hf"
    ckptstream.export_hf(src, out, prefix="model.", max_shard_size=earlier)  # an earlier export
    tiny_config().save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    kill_mid_export(src, out, point)
    names = {p.name for p in out.iterdir()}
    assert any(".ckptstream-tmp-" in n for n in names)  # killed for real, mid-way
    now = {p.name: p.read_bytes() for p in out.iterdir() if ".ckptstream-tmp-" not in p.name}
    new_shard = "model-00001-of-00008.safetensors"  # the new export's first, renamed in at "publish"
    if point == "stream" or earlier == "60KB":  # the earlier export is there, whole, and loads
        assert {n: b for n, b in now.items() if n != new_shard or point == "stream"} == before
        assert (point == "publish") == (new_shard in now and new_shard not in before)
        assert_reloads(out, model)
    else:
        assert "model.safetensors.index.json" not in names
        assert "model.safetensors" not in names
        from transformers import GPT2LMHeadModel

        with pytest.raises(OSError, match=r"model\.safetensors"):
            GPT2LMHeadModel.from_pretrained(out)
    ckptstream.export_hf(src, out, prefix="model.", max_shard_size="40KB")
    check_folder(out)  # no temp left, the index matches the shards
    assert_reloads(out, model)
