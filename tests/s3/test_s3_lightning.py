"""StreamCheckpointIO on s3:// URLs of a real S3 server (rclone): the scenarios of
tests/test_lightning_urls.py, with the objects and incomplete uploads listed by a plain client."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstream.lightning import StreamCheckpointIO
from tests.lightningutil import LIGHTNING_WARNINGS
from tests.s3.s3util import Bucket, s3, s3_server  # noqa: F401
from tests.test_lightning_urls import Where, removal_waits_for_the_save, round_trip, trainer_resumes_from_a_url

pytestmark = [*LIGHTNING_WARNINGS, pytest.mark.filterwarnings("ignore:.*The dirpath has changed.*")]


def on_s3(s3: Bucket) -> Where:
    def names() -> list[str]:
        return sorted(s3.keys()) + [f"upload:{u}" for u in s3.uploads()]

    return Where(s3.url, names)


@pytest.mark.parametrize("mode", [None, "device"], ids=str)
def test_save_load_and_remove_on_s3(mode: str | None, s3: Bucket) -> None:
    round_trip(StreamCheckpointIO(mode), on_s3(s3))


def test_a_removal_waits_for_the_save_on_s3(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    removal_waits_for_the_save(StreamCheckpointIO("device"), on_s3(s3), monkeypatch)


def test_a_trainer_resumes_from_s3(s3: Bucket, tmp_path: Path) -> None:
    trainer_resumes_from_a_url(StreamCheckpointIO("device"), on_s3(s3), tmp_path)
