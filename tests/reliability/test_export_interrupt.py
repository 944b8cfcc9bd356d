"""An export killed for real (SIGKILL of a child process) leaves no folder that transformers
takes as complete: killed while the tensors stream, an earlier export in OUT is still there,
whole; killed while the files are renamed in, there is no index. A later export then succeeds
and leaves no temp behind."""

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


@pytest.mark.parametrize("point", ["stream", "publish"])
def test_a_killed_export_never_looks_complete(tmp_path: Path, point: str) -> None:
    model = tiny_gpt2()
    src = tmp_path / "state.safetensors"
    ckptstream.save(trained_state(model), src)
    out = tmp_path / "hf"
    ckptstream.export_hf(src, out, prefix="model.", max_shard_size="60KB")  # an earlier export
    tiny_config().save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    kill_mid_export(src, out, point)
    names = {p.name for p in out.iterdir()}
    assert any(".ckptstream-tmp-" in n for n in names)  # killed for real, mid-way
    if point == "stream":  # nothing in OUT changed yet: the earlier export is there, whole
        assert {p.name: p.read_bytes() for p in out.iterdir() if ".ckptstream-tmp-" not in p.name} == before
    else:
        assert "model.safetensors.index.json" not in names
        assert "model.safetensors" not in names
        from transformers import GPT2LMHeadModel

        with pytest.raises(OSError, match=r"model\.safetensors"):
            GPT2LMHeadModel.from_pretrained(out)
    ckptstream.export_hf(src, out, prefix="model.", max_shard_size="40KB")
    check_folder(out)  # no temp left, the index matches the shards
    assert_reloads(out, model)
