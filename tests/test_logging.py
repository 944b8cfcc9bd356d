"""The engine and the storages say what they decided at DEBUG on the ``ckptstream`` logger
(O_DIRECT or not, the grid, the threads and buffers, the read layout, the hot-load tune), and
nothing at INFO or above: a load that goes as planned is silent unless asked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import ckptstream
from ckptstream._engine import read
from tests.helpers import assert_bytes_equal, random_tensor


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("ckptstream"))


def test_a_save_and_a_load_log_their_decisions_at_debug_only(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.safetensors"
    state = {"w": random_tensor((256, 1024)), "b": random_tensor(77)}
    cfg = ckptstream.Settings(buffer_size=64 << 10, num_buffers=4, io_threads=2, direct_io="auto")
    seen: list[logging.LogRecord] = []
    with caplog.at_level(logging.DEBUG, logger="ckptstream"):
        ckptstream.save(state, path, settings=cfg)
        saved = _messages(caplog)
        seen += caplog.records
        caplog.clear()
        loaded = ckptstream.load(path, mmap=False, settings=cfg)
        load_log = _messages(caplog)
        seen += caplog.records
        caplog.clear()
        monkeypatch.setattr(read, "HOT_FROM", 0)  # the file is in the page cache: a hot load, whatever its size
        hot = ckptstream.load(path, mmap=False, settings=ckptstream.Settings(
            buffer_size=64 << 10, num_buffers=2, io_threads=1, hot_io_threads=2))
        hot_log = _messages(caplog)
        seen += caplog.records
    assert_bytes_equal(loaded["w"], state["w"])
    assert_bytes_equal(hot["w"], state["w"])
    assert f"{path.parent}" in saved
    assert ("O_DIRECT writes" in saved) or ("buffered writes" in saved)  # which one, the file system says
    assert "on a grid of" in saved
    assert "2 I/O threads, 4 staging buffers of 65536 bytes" in saved
    assert "one contiguous range of the chunks per thread" in load_log
    assert "2 I/O threads" in load_log
    assert "hot load into host memory: 2 readers" in hot_log
    assert [r.getMessage() for r in seen if r.levelno >= logging.INFO] == []


def test_nothing_at_info_or_above_by_default(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ckptstream"):
        ckptstream.save({"w": random_tensor(5000)}, tmp_path / "c.safetensors")
        ckptstream.load(tmp_path / "c.safetensors", mmap=False)
    assert caplog.records == []
