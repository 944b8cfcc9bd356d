"""Complex tensors: complex64 is safetensors' C64, stored and read byte for byte and both ways
with safetensors' own writer and reader; complex128 and complex32, which safetensors has no name
for, are refused before any file with the way to store them (``torch.view_as_real``)."""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ckptstream
from tests.helpers import as_bytes


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def complex64_tensors() -> dict[str, torch.Tensor]:
    return {
        "matrix": torch.randn(33, 17, dtype=torch.complex64),
        "transposed": torch.randn(6, 9, dtype=torch.complex64).t(),
        "scalar": torch.randn((), dtype=torch.complex64),
        "empty": torch.randn(0, 4, dtype=torch.complex64),
        "nan_payload": torch.tensor([complex(float("nan"), -0.0), complex(float("inf"), 1e-42)]),
    }


def table(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    parsed: dict[str, Any] = json.loads(raw[8 : 8 + n])
    parsed.pop("__metadata__", None)
    return parsed


def assert_same(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), key
    assert as_bytes(got) == as_bytes(want), key


def test_complex64_round_trips_byte_for_byte(tmp_path: Path) -> None:
    tensors = complex64_tensors()
    state = {"model": tensors, "optim": [tensors["matrix"] * 2], "step": 4}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    for mmap in (None, False):
        back = ckptstream.load(path, mmap=mmap)
        for key, t in tensors.items():
            assert_same(back["model"][key], t, key)
        assert_same(back["optim"][0], tensors["matrix"] * 2, "optim")
    into: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in tensors.items()}, "optim": [torch.zeros(33, 17,
            dtype=torch.complex64)], "step": 0}  # fmt: skip
    ckptstream.load_into(into, path)
    with ckptstream.open(path) as reader:
        assert reader.entry("model.matrix").dtype_name == "C64"
        for key, t in tensors.items():
            assert_same(into["model"][key], t, key)
            assert_same(reader.read(f"model.{key}"), t, key)
    ckptstream.verify(path)


def test_complex64_is_read_and_written_as_safetensors_does(tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in complex64_tensors().items()}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ckptstream.save(tensors, ours)
    safetensors.torch.save_file(tensors, str(theirs))
    assert table(ours) == table(theirs)  # the same entries: C64, shapes, offsets
    assert {entry["dtype"] for entry in table(ours).values()} == {"C64"}
    by_them, by_us = safetensors.torch.load_file(str(ours)), ckptstream.load(theirs)
    for key, t in tensors.items():
        assert_same(by_them[key], t, key)
        assert_same(by_us[key], t, key)


@pytest.mark.parametrize(("dtype", "parts"), [(torch.complex128, torch.float64), (torch.complex32, torch.float16)],
                         ids=["complex128", "complex32"])
def test_unnamed_complex_is_refused_with_the_way_to_store_it(tmp_path: Path, dtype: torch.dtype,
                                                             parts: torch.dtype) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "ComplexHalf support is experimental"
        z = torch.randn(12, 5, dtype=torch.complex128).to(dtype)
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(ckptstream.UnsupportedTypeError) as e:
        ckptstream.save({"model": {"z": z}}, path)
    assert str(e.value).startswith(f"model.z: dtype {dtype} has no safetensors name: store torch.view_as_real(t) "
                                   f"(its {parts} real and imaginary parts) and torch.view_as_complex() it")
    assert list(tmp_path.iterdir()) == []
    ckptstream.save({"model": {"z": torch.view_as_real(z)}}, path)  # as the message says
    back = torch.view_as_complex(ckptstream.load(path)["model"]["z"])
    assert_same(back, z, "z")
