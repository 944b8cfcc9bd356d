"""Compatibility with ckptstream 0.1.0: its public names and keyword arguments still work, its
deprecated spellings warn and work, and its files load to the same state; a save of that state
writes the very same bytes (tests/data/format_v1.safetensors, written by 0.1.0)."""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

import ckptstream
from tests.helpers import as_bytes, assert_bytes_equal, assert_same_state, random_tensor

DATA = Path(__file__).resolve().parent / "data"

# ckptstream 0.1.0's __all__, and each function's keyword arguments then
PUBLIC_0_1_0 = [
    "CkptStreamError", "CorruptCheckpointError", "Settings", "StateMismatchError", "StateMismatchWarning",
    "TruncatedFileError", "UnsupportedTypeError", "current_settings", "device_to_file", "file_to_device", "load",
    "load_into", "read_metadata", "save", "settings", "verify",
]  # fmt: skip
KEYWORDS_0_1_0 = {
    "device_to_file": ["offset", "buffer_size", "num_buffers", "stream"],
    "file_to_device": ["offset", "buffer_size", "num_buffers", "stream"],
    "load": ["device", "verify", "progress", "buffer_size", "num_buffers"],
    "load_into": ["strict", "verify", "progress", "buffer_size", "num_buffers"],
    "save": ["metadata", "checksum", "progress", "buffer_size", "num_buffers", "direct_io"],
    "verify": [],
    "read_metadata": [],
}
SETTINGS_FIELDS_0_1_0 = ["buffer_size", "num_buffers", "io_threads", "direct_io"]


def test_every_public_name_of_0_1_0_still_exists() -> None:
    """Deprecated ones too: ``current_settings`` (out of ``__all__``, with a DeprecationWarning)
    and the per-call settings keywords where 0.1.0 had them (taken by a typed ``**legacy``, with a
    DeprecationWarning; test_api_deprecations.py calls every function with them)."""
    for name in [*PUBLIC_0_1_0, "staging_bytes", "release_staging"]:  # the last two: since 0.1.0
        if name == "current_settings":
            assert name not in ckptstream.__all__
            with pytest.warns(DeprecationWarning, match="current_settings"):
                assert getattr(ckptstream, name) is not None
            continue
        assert name in ckptstream.__all__, name
        assert getattr(ckptstream, name) is not None, name
    for name, keywords in KEYWORDS_0_1_0.items():
        params = inspect.signature(getattr(ckptstream, name)).parameters
        legacy = params.get("legacy")
        if set(keywords) & set(SETTINGS_FIELDS_0_1_0):
            assert legacy is not None, name
            assert legacy.kind is inspect.Parameter.VAR_KEYWORD, name
        else:  # it took none then, and takes none now
            assert legacy is None, name
        for keyword in keywords:
            if keyword in SETTINGS_FIELDS_0_1_0:
                continue  # through **legacy
            assert keyword in params, (name, keyword)
            assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, (name, keyword)
    assert [f for f in SETTINGS_FIELDS_0_1_0 if f not in inspect.signature(ckptstream.Settings).parameters] == []
    for error in ("CorruptCheckpointError", "StateMismatchError"):
        assert issubclass(getattr(ckptstream, error), ValueError)
    assert issubclass(ckptstream.UnsupportedTypeError, TypeError)
    assert issubclass(ckptstream.TruncatedFileError, EOFError)


@pytest.mark.parametrize("verify", [True, False])
def test_verify_argument_warns_and_works(tmp_path: Path, verify: bool) -> None:
    state = {"a": random_tensor(100), "b": random_tensor(7, torch.int16)}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # the last byte of the file: in "b" (int16 after float32)
    path.write_bytes(bytes(raw))
    if verify:  # checks the checksums, as checksum=True does
        with pytest.warns(DeprecationWarning, match=r"load\(verify=...\) is deprecated: use checksum="), \
                pytest.raises(ckptstream.CorruptCheckpointError, match="CRC-32C"):  # fmt: skip
            ckptstream.load(path, verify=True)
        with pytest.warns(DeprecationWarning, match=r"load_into\(verify=...\) is deprecated"), \
                pytest.raises(ckptstream.CorruptCheckpointError, match="CRC-32C"):  # fmt: skip
            ckptstream.load_into({k: torch.empty_like(v) for k, v in state.items()}, path, verify=True)
        return
    with pytest.warns(DeprecationWarning, match=r"load\(verify=...\) is deprecated") as record:
        loaded = ckptstream.load(path, verify=False)
    assert record[0].filename == __file__  # points at the caller
    assert_bytes_equal(loaded["a"], state["a"])
    assert as_bytes(loaded["b"]) == as_bytes(state["b"])[:-1] + bytes([as_bytes(state["b"])[-1] ^ 0x01])
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.warns(DeprecationWarning, match=r"load_into\(verify=...\) is deprecated") as record:
        ckptstream.load_into(targets, path, verify=False)
    assert record[0].filename == __file__
    assert_bytes_equal(targets["b"], loaded["b"])


def test_checksum_argument_does_not_warn(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"a": random_tensor(3)}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptstream.load(path, checksum=False)
        ckptstream.load_into({"a": torch.empty(3)}, path, checksum=True)


def test_none_per_call_means_inherit(tmp_path: Path) -> None:
    """0.1.0's per-call keywords (deprecated) with None: the settings in force."""
    src = random_tensor(3000)
    path = tmp_path / "t.bin"
    deprecated = pytest.warns(DeprecationWarning, match=r"buffer_size=\.\.\..* is deprecated: pass settings=")
    dst = torch.empty_like(src)
    with ckptstream.settings(buffer_size=4096, num_buffers=2):
        with deprecated:
            written = ckptstream.device_to_file(src, path, buffer_size=None, num_buffers=None)
        assert written == src.nbytes
        with deprecated:
            ckptstream.file_to_device(path, dst, buffer_size=None, num_buffers=None)
        with deprecated:
            ckptstream.save({"s": src}, tmp_path / "c.safetensors", buffer_size=None, num_buffers=None, direct_io=None)
        with deprecated:
            loaded = ckptstream.load(tmp_path / "c.safetensors", buffer_size=None, num_buffers=None)
    assert_bytes_equal(dst, src)
    assert_bytes_equal(loaded["s"], src)


def test_settings_with_the_0_1_0_spellings_of_direct_io() -> None:
    # 0.1.0's spellings: True / False / None
    assert ckptstream.Settings(direct_io=None).direct_io is ckptstream.DirectIO.AUTO
    assert ckptstream.Settings(direct_io=True).direct_io is ckptstream.DirectIO.ON
    assert ckptstream.Settings(direct_io=False).direct_io is ckptstream.DirectIO.OFF
    assert ckptstream.Settings(direct_io=None) == ckptstream.Settings()
    with ckptstream.settings(direct_io=None) as s:
        assert s.direct_io is ckptstream.DirectIO.AUTO
    with pytest.raises(ValueError, match="multiple of 4096"):
        ckptstream.Settings(buffer_size=5000, direct_io=True)


# --- the file format, byte for byte -------------------------------------------------------------


def _format_v1() -> ModuleType:
    spec = importlib.util.spec_from_file_location("format_v1", DATA / "format_v1.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_0_1_0_file_loads_to_the_same_state() -> None:
    fixture = _format_v1()
    path = DATA / "format_v1.safetensors"
    expected = fixture.state()
    ckptstream.verify(path)
    assert ckptstream.read_metadata(path) == fixture.METADATA
    loaded = ckptstream.load(path)
    assert_same_state(loaded, expected)
    model = loaded["model"]
    assert model["emb"] is model["head"]  # the tensor saved twice is one tensor
    assert model["w_t"].untyped_storage().data_ptr() == model["w"].untyped_storage().data_ptr()
    assert model["w_t"].stride() == (1, 6)
    targets = fixture.state()
    for t in (targets["model"]["w"], targets["model"]["emb"], targets["optim"][0]["exp_avg"]):
        t.zero_()
    ckptstream.load_into(targets, path)
    assert_same_state(targets, expected)


def test_saving_the_same_state_writes_the_same_bytes(tmp_path: Path) -> None:
    fixture = _format_v1()
    path = tmp_path / "format_v1.safetensors"
    ckptstream.save(fixture.state(), path, metadata=fixture.METADATA)
    expected = (DATA / "format_v1.safetensors").read_bytes()
    written = path.read_bytes()
    first = next((i for i, (a, b) in enumerate(zip(written, expected, strict=False)) if a != b), None)
    assert (len(written), first) == (len(expected), None), (
        f"differs from byte {first}: {written[max(0, (first or 0) - 40):(first or 0) + 40]!r} "
        f"vs {expected[max(0, (first or 0) - 40):(first or 0) + 40]!r}")
