"""Settings: scoped overrides, the ``settings=`` argument of every I/O function, the
``CKPTSTREAM_*`` environment (read at the first transfer, never at import). The deprecated
per-call keywords are tested in test_api_deprecations.py."""

from __future__ import annotations

import dataclasses
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
from ckptstream._export.copy import Copier
from tests.helpers import assert_bytes_equal, random_bytes, random_tensor, spy_on_staging

# every setting's variable, derived from the fields: the table of _settings is checked against it
ENV = tuple(f"CKPTSTREAM_{field.name.upper()}" for field in dataclasses.fields(Settings))
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_settings_scoping() -> None:
    base = _settings.current_settings()
    with ckptstream.settings(buffer_size=12345) as outer:
        assert _settings.current_settings() == outer
        assert (outer.buffer_size, outer.num_buffers, outer.io_threads) == (12345, base.num_buffers, base.io_threads)
        with ckptstream.settings(num_buffers=3, io_threads=2) as inner:
            assert (inner.buffer_size, inner.num_buffers, inner.io_threads) == (12345, 3, 2)
            assert _settings.current_settings() == inner
        assert _settings.current_settings() == outer
        with pytest.raises(ZeroDivisionError), ckptstream.settings(buffer_size=99):
            _ = 1 // (_settings.current_settings().buffer_size - 99)
        assert _settings.current_settings() == outer
        with pytest.raises(TypeError), ckptstream.settings(buffer_size=1, nope=2):  # type: ignore[call-arg]
            pass
        assert _settings.current_settings() == outer
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(_settings.current_settings().buffer_size))
        thread.start()
        thread.join()
        assert seen == [base.buffer_size]  # scoped to this thread
    assert _settings.current_settings() == base


def test_settings_and_arguments_choose_the_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = spy_on_staging(monkeypatch)
    src, path = random_bytes(10000), tmp_path / "t.bin"
    with ckptstream.settings(buffer_size=1000, num_buffers=2):
        ckptstream.device_to_file(src, path)
        # a Settings value is complete: the fields it leaves out take Settings' defaults, not the scope's
        ckptstream.device_to_file(src, path, settings=Settings(buffer_size=3000))
        ckptstream.file_to_device(path, src.view(100, 100).t(), settings=Settings(buffer_size=2000))  # staged
    # the default 8 buffers, as many as the chunks need: 4 of 3000 bytes, 5 of 2000
    assert taken == [(1000, 2), (3000, 4), (2000, 5)]


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="io_threads"), ckptstream.settings(io_threads=0):
        pass
    with pytest.raises(ValueError, match="direct_io"), ckptstream.settings(direct_io="yes"):
        pass
    with pytest.raises(TypeError, match="buffer_sise"), ckptstream.settings(buffer_sise=1 << 20):  # type: ignore[call-arg]
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
        assert _settings.current_settings() == ckptstream.Settings(12288, 3, 2, direct)
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


def _another_value(default: object) -> tuple[object, str]:
    """A valid value of a setting other than its default, and how the environment spells it."""
    if isinstance(default, DirectIO):
        other = next(d for d in DirectIO if d is not default)
        return other, other.value
    if isinstance(default, int) and not isinstance(default, bool):
        return default + 4096, str(default + 4096)  # a multiple of 4096 away: every direct_io takes it
    if isinstance(default, float):
        return default + 1.5, str(default + 1.5)
    raise AssertionError(f"a setting of type {type(default).__name__}: say here how the environment spells one")


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Settings)])
def test_every_setting_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    """``CKPTSTREAM_<SETTING>`` sets that setting alone, for every field of Settings (a variable
    misspelt in the table is never read); the README's table names the same variable."""
    variable = f"CKPTSTREAM_{field.upper()}"
    assert _settings._ENVIRONMENT.get(field) == variable
    value, raw = _another_value(getattr(Settings(), field))
    monkeypatch.setenv(variable, raw)
    expected: dict[str, Any] = {field: value}
    assert _settings._from_environment() == dataclasses.replace(Settings(), **expected)
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| `{field}` |")]
    assert len(rows) == 1, rows
    assert f"| `{variable}`" in rows[0], rows


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
    code = ("from ckptstream import _settings; s = _settings.current_settings(); "
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


def _io_calls(tmp_path: Path) -> dict[str, Callable[..., Callable[[], torch.Tensor]]]:
    """Every public I/O function, called on small files made beforehand (with the environment
    unset), taking ``settings=`` (or the deprecated keywords) as keyword arguments; each returns
    a function that gives what it moved (read back where it wrote a file), to compare byte for
    byte with ``TENSOR``."""
    t = TENSOR.clone()
    ckpt = tmp_path / "c.safetensors"
    raw = tmp_path / "t.bin"
    ckptstream.save({"w": t}, ckpt)
    ckptstream.device_to_file(t, raw)

    def saved(path: Path) -> Callable[[], torch.Tensor]:
        return lambda: ckptstream.load(path, mmap=False)["w"]

    def save(**kw: Any) -> Callable[[], torch.Tensor]:
        ckptstream.save({"w": t}, tmp_path / "s.safetensors", **kw)
        return saved(tmp_path / "s.safetensors")

    def save_async(**kw: Any) -> Callable[[], torch.Tensor]:
        ckptstream.save_async({"w": t}, tmp_path / "a.safetensors", **kw).result()
        return saved(tmp_path / "a.safetensors")

    def verify(**kw: Any) -> Callable[[], torch.Tensor]:
        ckptstream.verify(ckpt, **kw)
        return saved(ckpt)

    def read_with_open(**kw: Any) -> Callable[[], torch.Tensor]:
        with ckptstream.open(ckpt, **kw) as reader:
            out = reader.read("w")
        return lambda: out

    def device_to_file(**kw: Any) -> Callable[[], torch.Tensor]:
        ckptstream.device_to_file(t, tmp_path / "d.bin", **kw)
        return lambda: torch.frombuffer(bytearray((tmp_path / "d.bin").read_bytes()), dtype=t.dtype)

    def file_to_device(**kw: Any) -> Callable[[], torch.Tensor]:
        out = torch.full_like(t, float("nan"))
        ckptstream.file_to_device(raw, out, **kw)
        return lambda: out

    def export_hf(**kw: Any) -> Callable[[], torch.Tensor]:
        ckptstream.export_hf(ckpt, tmp_path / "hf", **kw)
        return saved(tmp_path / "hf" / "model.safetensors")

    def manager(**kw: Any) -> Callable[[], torch.Tensor]:
        with ckptstream.CheckpointManager(tmp_path / "ckpts", keep=1, **kw) as ckpts:
            ckpts.save({"w": t}, (ckpts.latest_step() or 0) + 1, blocking=True)
            return saved(Path(ckpts.path()))

    def load_into(**kw: Any) -> Callable[[], torch.Tensor]:
        out = torch.full_like(t, float("nan"))
        ckptstream.load_into({"w": out}, ckpt, **kw)
        return lambda: out

    def load(**kw: Any) -> Callable[[], torch.Tensor]:
        out = ckptstream.load(ckpt, mmap=False, **kw)["w"]  # the copying load runs the engine
        return lambda: out

    return {
        "save": save,
        "save_async": save_async,
        "load": load,
        "load_into": load_into,
        "verify": verify,
        "open": read_with_open,
        "device_to_file": device_to_file,
        "file_to_device": file_to_device,
        "export_hf": export_hf,
        "CheckpointManager": manager,
    }


TENSOR = random_tensor(1000)


@pytest.fixture
def engines_made(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings of every engine made meanwhile."""
    made: list[Settings] = []
    real = Engine.__init__

    def spy(self: Engine, file: Any, pieces: Any, cfg: Settings, **kwargs: Any) -> None:
        made.append(cfg)
        real(self, file, pieces, cfg, **kwargs)

    monkeypatch.setattr(Engine, "__init__", spy)
    copier = Copier.__init__  # export_hf's own engine

    def spy_copier(self: Copier, tensors: Any, begins: Any, data_start: int, sink: Any, cfg: Settings,
                   *args: Any) -> None:
        made.append(cfg)
        copier(self, tensors, begins, data_start, sink, cfg, *args)

    monkeypatch.setattr(Copier, "__init__", spy_copier)
    return made


CALLS = ["save", "save_async", "load", "load_into", "verify", "open", "device_to_file", "file_to_device", "export_hf",
         "CheckpointManager"]
CHOSEN = Settings(buffer_size=12288, num_buffers=3, io_threads=2, direct_io=DirectIO.OFF)


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("call", CALLS)
def test_every_io_function_takes_a_settings_value(tmp_path: Path, engines_made: list[Settings], call: str) -> None:
    """``settings=`` is the whole of the call's settings; without it, those in force."""
    run = _io_calls(tmp_path)[call]
    scopes: list[dict[str, Any]] = [{}, {"buffer_size": 8192, "num_buffers": 5, "io_threads": 3, "direct_io": "auto"}]
    for scope in scopes:
        with ckptstream.settings(**scope) as in_force:
            engines_made.clear()
            got = run()
            assert engines_made
            assert set(engines_made) == {in_force}
            assert_bytes_equal(got(), TENSOR)
            engines_made.clear()
            got = run(settings=CHOSEN)  # over the scope, whole
            assert set(engines_made) == {CHOSEN}
            assert_bytes_equal(got(), TENSOR)
    with pytest.raises(TypeError, match=r"settings=\.\.\.\) takes a ckptstream\.Settings .* got dict"):
        run(settings={"buffer_size": 8192})
    with pytest.raises(TypeError, match="unexpected keyword argument 'buffer_sise'"):
        run(buffer_sise=8192)


def test_read_metadata_reads_only_the_header(tmp_path: Path, engines_made: list[Settings]) -> None:
    """read_metadata runs no transfer, so it takes no settings."""
    ckptstream.save({"w": random_tensor(3)}, tmp_path / "c.safetensors", metadata={"k": "v"})
    engines_made.clear()
    assert ckptstream.read_metadata(tmp_path / "c.safetensors") == {"k": "v"}
    assert engines_made == []
    with pytest.raises(TypeError, match="unexpected keyword argument 'settings'"):
        ckptstream.read_metadata(tmp_path / "c.safetensors", settings=CHOSEN)  # type: ignore[call-arg]


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
