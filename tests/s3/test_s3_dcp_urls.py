"""DCP in a folder of a real S3 server (rclone): the scenario of tests/dcp/test_dcp_urls.py
(one rank: save, load, checkpoint_id, the command's verify and inspect, a missing rank file);
two gloo ranks: tests/s3/test_s3_checkpoints.py."""

from __future__ import annotations

import pytest

from tests.dcp.test_dcp_urls import Folder, save_and_load
from tests.s3.s3util import Bucket, s3, s3_server  # noqa: F401


def test_save_and_load_in_an_s3_folder(s3: Bucket, capsys: pytest.CaptureFixture[str]) -> None:
    def names(prefix: str) -> list[str]:
        return [k.removeprefix(prefix) for k in s3.keys(prefix)]

    save_and_load(Folder(s3.url, lambda key: s3.raw.delete_object(Bucket=s3.name, Key=key), names), capsys)
    assert s3.uploads() == []
