"""Settings: scoped overrides, per-call arguments, the ``CKPTSTREAM_*`` environment (read at
the first transfer, never at import), and the four per-call options on every I/O function."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import DirectIO, Settings, _settings
from ckptstream._engine.engine import Engine
from helpers import random_bytes, random_tensor, spy_on_staging

ENV = ("CKPTSTREAM_BUFFER_SIZE", "CKPTSTREAM_NUM_BUFFERS", "CKPTSTREAM_IO_THREADS", "CKPTSTREAM_DIRECT_IO")


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_settings_scoping() -> None:
    base = ckptstream.current_settings()
    with ckptstream.settings(buffer_size=12345) as outer:
        assert ckptstream.current_settings() == outer
        assert (outer.buffer_size, outer.num_buffers, outer.io_threads) == (12345, base.num_buffers, base.io_threads)
        with ckptstream.settings(num_buffers=3, io_threads=2) as inner:
            assert (inner.buffer_size, inner.num_buffers, inner.io_threads) == (12345, 3, 2)
            assert ckptstream.current_settings() == inner
        assert ckptstream.current_settings() == outer
        with pytest.raises(ZeroDivisionError), ckptstream.settings(buffer_size=99):
            _ = 1 // (ckptstream.current_settings().buffer_size - 99)
        assert ckptstream.current_settings() == outer
        with pytest.raises(TypeError), ckptstream.settings(buffer_size=1, nope=2):
            pass
        assert ckptstream.current_settings() == outer
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(ckptstream.current_settings().buffer_size))
        thread.start()
        thread.join()
        assert seen == [base.buffer_size]  # scoped to this thread
    assert ckptstream.current_settings() == base


def test_settings_and_arguments_choose_the_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = spy_on_staging(monkeypatch)
    src, path = random_bytes(10000), tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=1000, num_buffers=2):
        ckptstream.device_to_file(src, path)
        ckptstream.device_to_file(src, path, buffer_size=3000)
        ckptstream.file_to_device(path, src.view(100, 100).t(), num_buffers=3)  # non-contiguous: staged
    assert taken == [(1000, 2), (3000, 2), (1000, 3)]


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="io_threads"), ckptstream.settings(io_threads=0):
        pass
    with pytest.raises(ValueError, match="direct_io"), ckptstream.settings(direct_io="yes"):
        pass
    with pytest.raises(TypeError, match="buffer_sise"), ckptstream.settings(buffer_sise=1 << 20):
        pass


# --- the environment ---------------------------------------------------------------------------


@pytest.mark.usefixtures("clean_environment")
def test_environment_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"CKPTSTREAM_BUFFER_SIZE": "12288", "CKPTSTREAM_NUM_BUFFERS": "3", "CKPTSTREAM_IO_THREADS": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for raw, direct in [("auto", DirectIO.AUTO), ("ON", DirectIO.ON), ("Off", DirectIO.OFF)]:
        monkeypatch.setenv("CKPTSTREAM_DIRECT_IO", raw)
        assert _settings._from_environment() == ckptstream.Settings(12288, 3, 2, direct)
        assert ckptstream.current_settings() == ckptstream.Settings(12288, 3, 2, direct)
    monkeypatch.setenv("CKPTSTREAM_DIRECT_IO", "maybe")
    with pytest.raises(ValueError, match="CKPTSTREAM_DIRECT_IO"):
        _settings._from_environment()
    monkeypatch.delenv("CKPTSTREAM_DIRECT_IO")
    monkeypatch.setenv("CKPTSTREAM_BUFFER_SIZE", "16M")
    with pytest.raises(ValueError, match="CKPTSTREAM_BUFFER_SIZE"):
        _settings._from_environment()
    monkeypatch.setenv("CKPTSTREAM_BUFFER_SIZE", "4096")
    monkeypatch.setenv("CKPTSTREAM_NUM_BUFFERS", "0")
    with pytest.raises(ValueError, match="CKPTSTREAM_NUM_BUFFERS"):
        _settings._from_environment()


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize(("raw", "direct"), [("1", DirectIO.ON), ("true", DirectIO.ON), ("0", DirectIO.OFF),
                                             ("false", DirectIO.OFF)])
def test_environment_takes_the_0_1_0_spellings_of_direct_io(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                           direct: DirectIO) -> None:
    """ckptstream 0.1.0 read CKPTSTREAM_DIRECT_IO=1/true/0/false (and auto/on/off)."""
    monkeypatch.setenv("CKPTSTREAM_DIRECT_IO", raw)
    assert _settings._from_environment().direct_io is direct


@pytest.mark.timeout(120)
def test_environment_gives_the_defaults() -> None:
    env = dict(os.environ, CKPTSTREAM_BUFFER_SIZE="8192", CKPTSTREAM_NUM_BUFFERS="5",
               CKPTSTREAM_IO_THREADS="7", CKPTSTREAM_DIRECT_IO="off")
    code = ("import ckptstream; s = ckptstream.current_settings(); "
            "print(s.buffer_size, s.num_buffers, s.io_threads, s.direct_io.value)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.split() == ["8192", "5", "7", "off"]


@pytest.mark.timeout(120)
def test_a_bad_variable_does_not_break_the_import(tmp_path: Path) -> None:
    """``import ckptstream`` works; the first save or load names the variable, its value and the fix."""
    env = dict(os.environ, CKPTSTREAM_BUFFER_SIZE="16M")
    code = (
        "import sys, torch, ckptstream\n"
        "for call in (lambda: ckptstream.save({'w': torch.ones(3)}, sys.argv[1]),\n"
        "             lambda: ckptstream.load(sys.argv[1])):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        print('ValueError:', e)\n"
        "    else:\n"
        "        print('no error')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.safetensors")], env=env, capture_output=True,
                         text=True, timeout=100, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for line in lines:
        assert line.startswith("ValueError: environment variable CKPTSTREAM_BUFFER_SIZE='16M' is invalid"), line
        assert "fix or unset it" in line
    assert os.listdir(tmp_path) == []


def _io_calls(tmp_path: Path) -> dict[str, Callable[..., Any]]:
    """Every public I/O function, called on small files made beforehand (with the environment
    unset), taking per-call options as keyword arguments."""
    t = random_tensor(1000)
    ckpt = tmp_path / "c.safetensors"
    raw = tmp_path / "t.bin"
    ckptstream.save({"w": t}, ckpt)
    ckptstream.device_to_file(t, raw)

    def read_with_open(**kw: Any) -> Any:
        with ckptstream.open(ckpt, **kw) as reader:
            return reader.read("w")

    return {
        "save": lambda **kw: ckptstream.save({"w": t}, tmp_path / "s.safetensors", **kw),
        "load": lambda **kw: ckptstream.load(ckpt, mmap=False, **kw),  # the copying load runs the engine
        "load_into": lambda **kw: ckptstream.load_into({"w": torch.empty(1000)}, ckpt, **kw),
        "verify": lambda **kw: ckptstream.verify(ckpt, **kw),
        "open": read_with_open,
        "device_to_file": lambda **kw: ckptstream.device_to_file(t, tmp_path / "d.bin", **kw),
        "file_to_device": lambda **kw: ckptstream.file_to_device(raw, torch.empty(1000), **kw),
    }


@pytest.fixture
def engines_made(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings of every engine made meanwhile."""
    made: list[Settings] = []
    real = Engine.__init__

    def spy(self: Engine, file: Any, pieces: Any, cfg: Settings, **kwargs: Any) -> None:
        made.append(cfg)
        real(self, file, pieces, cfg, **kwargs)

    monkeypatch.setattr(Engine, "__init__", spy)
    return made


CALLS = ["save", "load", "load_into", "verify", "open", "device_to_file", "file_to_device"]


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("call", CALLS)
def test_every_io_function_takes_the_four_options(tmp_path: Path, engines_made: list[Settings], call: str) -> None:
    run = _io_calls(tmp_path)[call]
    engines_made.clear()
    run(buffer_size=12288, num_buffers=3, io_threads=2, direct_io="off")
    assert engines_made
    assert set(engines_made) == {Settings(12288, 3, 2, DirectIO.OFF)}
    engines_made.clear()
    with ckptstream.settings(buffer_size=8192, num_buffers=5, io_threads=3, direct_io="auto"):
        run(num_buffers=4)  # the others inherit the scope's
        run(buffer_size=None, num_buffers=None, io_threads=None, direct_io=None)  # None: inherit, as in 0.1.0
        run(buffer_size=ckptstream.INHERIT, direct_io=ckptstream.INHERIT)
    assert engines_made[0] == Settings(8192, 4, 3, DirectIO.AUTO)
    assert set(engines_made[1:]) == {Settings(8192, 5, 3, DirectIO.AUTO)}
    with pytest.raises(ValueError, match="num_buffers"):
        run(num_buffers=0)
    with pytest.raises(ValueError, match="direct_io"):
        run(direct_io="sometimes")


@pytest.mark.usefixtures("clean_environment")
def test_read_metadata_takes_the_four_options(tmp_path: Path) -> None:
    """read_metadata is an I/O function too: it takes the same per-call options as the others."""
    ckptstream.save({"w": random_tensor(3)}, tmp_path / "c.safetensors", metadata={"k": "v"})
    assert ckptstream.read_metadata(tmp_path / "c.safetensors", buffer_size=8192, num_buffers=2,
                                    io_threads=1, direct_io="off") == {"k": "v"}


@pytest.mark.parametrize("call", CALLS)
def test_a_bad_variable_names_itself_at_the_first_transfer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           call: str) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    run = _io_calls(tmp_path)[call]
    monkeypatch.setenv("CKPTSTREAM_IO_THREADS", "many")
    with pytest.raises(ValueError, match=r"environment variable CKPTSTREAM_IO_THREADS='many' is invalid"):
        run()
    monkeypatch.delenv("CKPTSTREAM_IO_THREADS")
    run()
