"""The deprecated spellings of the public API still work, each with a DeprecationWarning that
names the new way: the per-call ``buffer_size`` / ``num_buffers`` / ``io_threads`` /
``direct_io`` keywords (``settings=`` replaces them), ``INHERIT`` and ``current_settings``,
``SaveHandle.wait()`` (``result()``), ``CheckpointReader.read_slice`` (``get_slice``) and
``CheckpointManager.save(step, state)`` (``save(state, step)``)."""

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
LEGACY: Any = {"buffer_size": 12288, "num_buffers": 3, "io_threads": 2, "direct_io": "off"}


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _settings._ENVIRONMENT.values():
        monkeypatch.delenv(name, raising=False)


# --- the per-call keywords ---------------------------------------------------------------------


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("call", CALLS)
def test_every_io_function_still_takes_the_four_keywords(tmp_path: Path, engines_made: list[Settings],  # noqa: F811
                                                         call: str) -> None:
    """Over the settings in force, as in 0.1.0 (None and INHERIT: the value in force)."""
    run = _io_calls(tmp_path)[call]
    engines_made.clear()
    with pytest.warns(DeprecationWarning, match=rf"{call}\(buffer_size=\.\.\., num_buffers=\.\.\., .*{NEW_WAY}"):
        got = run(**LEGACY)
    assert engines_made
    assert set(engines_made) == {Settings(12288, 3, 2, DirectIO.OFF)}
    assert_bytes_equal(got(), TENSOR)
    with ckptstream.settings(buffer_size=8192, num_buffers=5, io_threads=3, direct_io="auto"):
        cases: list[tuple[dict[str, Any], Settings]] = [
            ({"num_buffers": 4}, Settings(8192, 4, 3, DirectIO.AUTO)),
            ({"buffer_size": None, "io_threads": None, "direct_io": None}, Settings(8192, 5, 3, DirectIO.AUTO)),
            ({"buffer_size": _settings.INHERIT}, Settings(8192, 5, 3, DirectIO.AUTO)),
        ]
        for keywords, expected in cases:
            engines_made.clear()
            with pytest.warns(DeprecationWarning, match=NEW_WAY):
                got = run(**keywords)
            assert set(engines_made) == {expected}, keywords
            assert_bytes_equal(got(), TENSOR)
    with pytest.warns(DeprecationWarning, match=NEW_WAY), pytest.raises(ValueError, match="num_buffers"):
        run(num_buffers=0)
    with pytest.raises(TypeError, match=r"settings= or the deprecated buffer_size=\.\.\., not both"):
        run(settings=Settings(), buffer_size=8192)


def test_the_warning_points_at_the_caller(tmp_path: Path) -> None:
    """stacklevel: the warning names the user's line, not ckptstream's."""
    with pytest.warns(DeprecationWarning, match=NEW_WAY) as caught:
        ckptstream.save({"w": TENSOR}, tmp_path / "c.safetensors", buffer_size=8192)
    with pytest.warns(DeprecationWarning, match=NEW_WAY) as more:
        ckptstream.CheckpointManager(tmp_path / "ckpts", num_buffers=2).close()
    assert [Path(w.filename).name for w in [*caught, *more]] == [Path(__file__).name] * 2
    assert_bytes_equal(ckptstream.load(tmp_path / "c.safetensors")["w"], TENSOR)


@pytest.mark.usefixtures("clean_environment")
def test_dcp_writer_and_reader_still_take_the_four_keywords(tmp_path: Path) -> None:
    from ckptstream.dcp import StreamReader, StreamWriter

    for kind in (StreamWriter, StreamReader):
        with pytest.warns(DeprecationWarning, match=rf"{kind.__name__}\(buffer_size=.*{NEW_WAY}"):
            made = kind(tmp_path, **LEGACY)
        assert made.cfg == Settings(12288, 3, 2, DirectIO.OFF)
        chosen = Settings(buffer_size=4096, num_buffers=2)
        assert kind(tmp_path, settings=chosen).cfg is chosen
        with ckptstream.settings(io_threads=5) as in_force:
            assert kind(tmp_path).cfg == in_force
        with pytest.raises(TypeError, match=r"takes a ckptstream\.Settings"):
            kind(tmp_path, settings=4096)  # type: ignore[arg-type]


def test_manager_keywords_apply_to_each_save_over_the_settings_then_in_force(
        tmp_path: Path, engines_made: list[Settings]) -> None:  # noqa: F811
    with pytest.warns(DeprecationWarning, match=rf"CheckpointManager\(num_buffers=\.\.\.\) {NEW_WAY}"):
        ckpts = ckptstream.CheckpointManager(tmp_path, num_buffers=3)
    with ckpts, ckptstream.settings(buffer_size=8192) as scope:
        engines_made.clear()
        ckpts.save({"w": TENSOR}, 1, blocking=True)
        assert set(engines_made) == {Settings(8192, 3, scope.io_threads, scope.direct_io)}
        assert_bytes_equal(ckpts.load(mmap=False)["w"], TENSOR)


def test_read_metadata_keywords_are_deprecated_and_change_nothing(tmp_path: Path) -> None:
    ckptstream.save({"w": random_tensor(3)}, tmp_path / "c.safetensors", metadata={"k": "v"})
    with pytest.warns(DeprecationWarning, match=r"read_metadata\(buffer_size=\.\.\., num_buffers=\.\.\., "
                                                rf"io_threads=\.\.\., direct_io=\.\.\.\) {NEW_WAY}"):
        assert ckptstream.read_metadata(tmp_path / "c.safetensors", **LEGACY) == {"k": "v"}
    with pytest.raises(TypeError, match="unexpected keyword argument 'buffer_sise'"):
        ckptstream.read_metadata(tmp_path / "c.safetensors", buffer_sise=1)  # type: ignore[call-arg]


def test_inherit_and_current_settings_left_the_public_api() -> None:
    assert "INHERIT" not in ckptstream.__all__
    assert "current_settings" not in ckptstream.__all__
    with pytest.warns(DeprecationWarning, match=r"ckptstream\.INHERIT is deprecated"):
        inherit = ckptstream.INHERIT  # type: ignore[attr-defined]
    assert inherit is _settings.INHERIT
    with ckptstream.settings(buffer_size=12345) as in_force:
        with pytest.warns(DeprecationWarning, match=r"current_settings\(\) is deprecated: `with ckptstream"):
            current: Any = ckptstream.current_settings  # type: ignore[attr-defined]
        assert current() == in_force
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = ckptstream.nothing  # type: ignore[attr-defined]


# --- two words for one thing -------------------------------------------------------------------


def test_save_handle_wait_is_result(tmp_path: Path) -> None:
    state: dict[str, Any] = {"w": random_tensor((33, 7)), "step": 5}
    handle = ckptstream.save_async(state, tmp_path / "c.safetensors")
    with pytest.warns(DeprecationWarning, match=r"SaveHandle\.wait\(\) is deprecated: use result\(\)"):
        assert handle.wait() == str(tmp_path / "c.safetensors")
    assert handle.result() == str(tmp_path / "c.safetensors")
    loaded = ckptstream.load(tmp_path / "c.safetensors")
    assert_bytes_equal(loaded["w"], state["w"])
    assert loaded["step"] == 5


def test_read_slice_is_get_slice(tmp_path: Path) -> None:
    w = random_tensor((40, 33))
    ckptstream.save({"w": w}, tmp_path / "c.safetensors")
    with ckptstream.open(tmp_path / "c.safetensors") as reader:
        with pytest.warns(DeprecationWarning, match=r"read_slice\(\) is deprecated: index get_slice\(key\)"):
            old = reader.read_slice("w", [5, 30], [2])
        assert_bytes_equal(old, w[5:7, 30:])
        assert_bytes_equal(reader.get_slice("w")[5:7, 30:], w[5:7, 30:])
        assert reader.get_slice("w", device="cpu")[3].device == torch.device("cpu")
        into = torch.full((3, 33), float("nan"))
        with pytest.warns(DeprecationWarning, match=r"read_slices\(\[\(key, offsets, lengths, into\)\]\)"):
            assert reader.read_slice("w", [10], [3], into=into) is into
        assert_bytes_equal(into, w[10:13])
        again = torch.full((3, 33), float("nan"))
        assert reader.read_slices([("w", [10], [3], again)])[0] is again
        assert_bytes_equal(again, w[10:13])


def test_manager_save_takes_the_state_first_and_recognises_the_old_order(tmp_path: Path) -> None:
    first: dict[str, Any] = {"w": random_tensor(100), "step": 1}
    second: dict[str, Any] = {"w": random_tensor(100), "step": 2}
    with ckptstream.CheckpointManager(tmp_path, keep=None) as ckpts:
        ckpts.save(first, 1, blocking=True)
        with pytest.warns(DeprecationWarning, match=r"save\(step, state\) is deprecated: pass the state first"):
            handle = ckpts.save(2, second, blocking=True)  # type: ignore[arg-type]
        assert handle.step == 2
        ckpts.save(state={"w": first["w"]}, step=3, blocking=True)
        assert ckpts.steps() == [1, 2, 3]
        for step, state in [(1, first), (2, second)]:
            loaded = ckpts.load(step)
            assert_bytes_equal(loaded["w"], state["w"])
            assert loaded["step"] == state["step"]
        target: dict[str, Any] = {"w": torch.full((100,), float("nan")), "step": 0}
        assert ckpts.load_into(target, 2)["step"] == 2
        assert_bytes_equal(target["w"], second["w"])
        with pytest.raises(ValueError, match="step must be an integer"):
            ckpts.save(first, "4")  # type: ignore[arg-type]
