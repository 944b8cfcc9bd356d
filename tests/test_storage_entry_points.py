"""A storage that a third party installs: a distribution declaring ``foo`` in the
``ckptstream.storages`` entry-point group adds ``foo://`` URLs, with no call to ``register``.
The distribution is a ``.dist-info`` folder and a module in a temporary folder on sys.path, as
pip would leave them in site-packages; its storage is the tests' in-memory one."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptstream
import ckptstream.storage
from ckptstream._storage import dispatch
from tests.helpers import assert_bytes_equal, random_tensor

MODULE = '''
from tests.memstore import MemStorage

STORE = MemStorage()


def make():
    return STORE
'''


def _install(site: Path, scheme: str, value: str, name: str = "ckptstream_foo") -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ckptstream.storage.ENTRY_POINTS}]\n{scheme} = {value}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "ckptstream_foo.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for scheme in ("foo", "bar"):
        dispatch.register(scheme, None)  # forget the storage made from the entry point
    sys.modules.pop("ckptstream_foo", None)


def test_an_installed_entry_point_adds_its_scheme(site: Path) -> None:
    with pytest.raises(ckptstream.UnsupportedStorageError, match=r"no storage for foo:// URLs"):
        ckptstream.load("foo://run/ckpt.safetensors")
    _install(site, "foo", "ckptstream_foo:make")
    state: dict[str, Any] = {"w": random_tensor((64, 33)), "step": 7}
    ckptstream.save(state, "foo://run/ckpt.safetensors")
    import ckptstream_foo  # type: ignore[import-not-found]

    assert set(ckptstream_foo.STORE.objects) == {"foo://run/ckpt.safetensors"}  # the bytes went to its storage
    loaded = ckptstream.load("foo://run/ckpt.safetensors")
    assert_bytes_equal(loaded["w"], state["w"])
    assert loaded["step"] == 7
    ckptstream.verify("foo://run/ckpt.safetensors")
    assert ckptstream.storage.storage_for("FOO://run") is ckptstream_foo.STORE


def test_a_broken_or_ambiguous_entry_point_is_named(site: Path) -> None:
    _install(site, "bar", "ckptstream_foo:missing")
    with pytest.raises(ckptstream.UnsupportedStorageError, match=r"ckptstream_foo:missing.*cannot be loaded"):
        ckptstream.load("bar://run/ckpt.safetensors")
    _install(site, "bar", "ckptstream_foo:make", name="ckptstream_bar")
    with pytest.raises(ckptstream.UnsupportedStorageError, match=r"several installed distributions"):
        ckptstream.load("bar://run/ckpt.safetensors")
