"""The deprecation paths of names that 0.1.0 released and that changed since, each working with
a DeprecationWarning that names the new way: the per-call keywords of 0.1.0's functions
(``settings=`` replaces them), ``load`` / ``load_into``'s ``verify=`` (``checksum=``) and
``current_settings``. Nothing else takes a deprecated spelling: the names that no release had
are gone, and using one fails as any unknown name does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import DirectIO, Settings, _settings
from tests.helpers import assert_bytes_equal, random_tensor
from tests.test_settings import CALLS, TENSOR, _io_calls, engines_made  # noqa: F401  (a fixture)

NEW_WAY = r"is deprecated: pass settings=ckptstream\.Settings\("
# 0.1.0's per-call keywords, function by function (tests/test_compat.py has its signatures)
RELEASED: dict[str, dict[str, Any]] = {
    "save": {"buffer_size": 12288, "num_buffers": 3, "direct_io": "off"},
    "load": {"buffer_size": 12288, "num_buffers": 3},
    "load_into": {"buffer_size": 12288, "num_buffers": 3},
    "device_to_file": {"buffer_size": 12288, "num_buffers": 3},
    "file_to_device": {"buffer_size": 12288, "num_buffers": 3},
}


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _settings._ENVIRONMENT.values():
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("call", sorted(RELEASED))
def test_0_1_0_functions_still_take_their_keywords(tmp_path: Path, engines_made: list[Settings],  # noqa: F811
                                                   call: str) -> None:
    """Over the settings in force, as in 0.1.0 (None: the value in force)."""
    run = _io_calls(tmp_path)[call]
    keywords = RELEASED[call]
    with ckptstream.settings(buffer_size=8192, num_buffers=5, io_threads=3, direct_io="auto") as scope:
        engines_made.clear()
        with pytest.warns(DeprecationWarning, match=rf"{call}\(buffer_size=\.\.\., num_buffers=\.\.\..*{NEW_WAY}"):
            got = run(**keywords)
        direct = DirectIO.OFF if "direct_io" in keywords else scope.direct_io
        assert set(engines_made) == {Settings(12288, 3, scope.io_threads, direct)}
        assert_bytes_equal(got(), TENSOR)
        engines_made.clear()
        with pytest.warns(DeprecationWarning, match=NEW_WAY):
            got = run(**{name: None for name in keywords})
        assert set(engines_made) == {scope}
        assert_bytes_equal(got(), TENSOR)
    with pytest.warns(DeprecationWarning, match=NEW_WAY), pytest.raises(ValueError, match="num_buffers"):
        run(num_buffers=0)
    with pytest.raises(TypeError, match=r"settings= or the deprecated buffer_size=\.\.\., not both"):
        run(settings=Settings(), buffer_size=8192)
    with pytest.raises(TypeError, match=rf"{call}\(\) got an unexpected keyword argument 'io_threads'"):
        run(io_threads=2)  # no release took it per call


@pytest.mark.parametrize("call", sorted(set(CALLS) - set(RELEASED)))
def test_calls_that_no_release_had_take_no_per_call_keywords(tmp_path: Path, call: str) -> None:
    run = _io_calls(tmp_path)[call]
    with pytest.raises(TypeError, match="unexpected keyword argument 'buffer_size'"):
        run(buffer_size=8192)


def test_the_warning_points_at_the_caller(tmp_path: Path) -> None:
    """stacklevel: the warning names the user's line, not ckptstream's."""
    with pytest.warns(DeprecationWarning, match=NEW_WAY) as caught:
        ckptstream.save({"w": TENSOR}, tmp_path / "c.safetensors", buffer_size=8192)
    with pytest.warns(DeprecationWarning, match=r"load\(verify=\.\.\.\) is deprecated: use checksum=") as more:
        loaded = ckptstream.load(tmp_path / "c.safetensors", verify=True)
    assert [Path(w.filename).name for w in [*caught, *more]] == [Path(__file__).name] * 2
    assert_bytes_equal(loaded["w"], TENSOR)


def test_current_settings_left_the_public_api_with_a_warning() -> None:
    assert "current_settings" not in ckptstream.__all__
    with ckptstream.settings(buffer_size=12345) as in_force:
        with pytest.warns(DeprecationWarning, match=r"current_settings\(\) is deprecated: `with ckptstream"):
            current: Any = ckptstream.current_settings  # type: ignore[attr-defined]
        assert current() == in_force
    with pytest.raises(AttributeError, match="no attribute 'INHERIT'"):
        _ = ckptstream.INHERIT  # type: ignore[attr-defined]


def test_the_shims_of_names_no_release_had_are_gone(tmp_path: Path) -> None:
    import ckptstream.dcp

    state: dict[str, Any] = {"w": random_tensor((33, 7)), "step": 5}
    handle = ckptstream.save_async(state, tmp_path / "c.safetensors")
    assert handle.result() == str(tmp_path / "c.safetensors")
    assert not hasattr(handle, "wait")
    with ckptstream.open(tmp_path / "c.safetensors") as reader:
        assert not hasattr(reader, "read_slice")
        assert_bytes_equal(reader.get_slice("w")[5:7, 3:], state["w"][5:7, 3:])
    assert not hasattr(ckptstream.dcp, "Staging")
    with pytest.raises(TypeError, match="staging"):
        ckptstream.dcp.StreamWriter(tmp_path / "d", staging="lazy")  # type: ignore[call-arg]
    with ckptstream.CheckpointManager(tmp_path / "ckpts") as ckpts:
        with pytest.raises(ValueError, match="step must be an integer"):
            ckpts.save(2, state)  # type: ignore[arg-type]
        ckpts.save(state, 2, blocking=True)
        target: dict[str, Any] = {"w": torch.full((33, 7), float("nan")), "step": 0}
        assert ckpts.load_into(target, 2)["step"] == 5
    assert_bytes_equal(target["w"], state["w"])
