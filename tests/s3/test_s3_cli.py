"""``ckptstream verify`` and ``inspect`` of an object store's URLs on a real S3 server: the URL of
one object is a file, its prefix a folder of checkpoint files."""

from __future__ import annotations

import pytest
import torch

import ckptstream
from ckptstream import cli
from tests.s3.s3util import Bucket, s3, s3_server  # noqa: F401


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_an_objects_url_is_a_file(s3: Bucket, capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url("run/a.safetensors")
    ckptstream.save({"w": torch.randn(64, 8), "step": 2}, url)
    status, out, err = run_cli(capsys, "verify", url)
    assert (status, out, err) == (0, f"{url}: OK (1 tensors, checksums verified)\n", "")
    status, out, _ = run_cli(capsys, "inspect", url)
    assert status == 0
    assert out.startswith(f"{url}: ckptstream 1, 1 tensors")
    ckptstream.save({"w": torch.randn(64, 8)}, s3.url("run/b.safetensors"))
    status, out, _ = run_cli(capsys, "verify", s3.url("run"))  # the prefix: a folder of checkpoint files
    assert (status, out.count(": OK (")) == (0, 2)
    raw = bytearray(s3.get("run/a.safetensors"))
    raw[-2] ^= 0x10
    s3.put("run/a.safetensors", bytes(raw))
    status, _, err = run_cli(capsys, "verify", url)
    assert status == 1
    assert f"{url}: tensor 'w'" in err
    status, _, err = run_cli(capsys, "verify", s3.url("run/none.safetensors"))
    assert status == 2
    assert "a folder that holds no checkpoint" not in err
