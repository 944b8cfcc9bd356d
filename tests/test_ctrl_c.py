"""What a Ctrl-C during a synchronous save shows: Python's plain report of a KeyboardInterrupt
saying that nothing was published, without the internal cancellation that stopped the transfer
(shown as its context only with ``CKPTSTREAM_DEBUG=1``), in a real process sent a real SIGINT
while the save streams."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import ckptstream
from tests.resume.trainutil import start_child


@pytest.mark.parametrize("debug", ["", "1"], ids=["plain", "debug"])
def test_ctrl_c_during_a_save_shows_a_plain_keyboard_interrupt(debug: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    child = start_child("child_async_signals.py", "sync-save", str(path), CKPTSTREAM_DEBUG=debug)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "waiting in the save's first chunk", line
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    said = f"--- stdout\n{line}{out}\n--- stderr\n{err}"
    assert child.returncode == -signal.SIGINT, said  # as Python ends on a KeyboardInterrupt
    # the last line says what the save left
    assert err.rstrip().endswith(f"\nKeyboardInterrupt: the save was interrupted; nothing was published: {path} "
                                 "is as it was"), said
    if debug:
        assert "ckptstream._engine.control.TransferCancelled: the transfer was cancelled" in err, said
        assert "During handling of the above exception, another exception occurred" in err, said
    else:
        assert err.count("Traceback (most recent call last)") == 1, said
        assert "TransferCancelled" not in err, said
        assert "During handling" not in err, said
    assert "the save was not interrupted" not in out, said
    assert torch.equal(ckptstream.load(path)["old"], torch.arange(4))  # the old checkpoint stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
