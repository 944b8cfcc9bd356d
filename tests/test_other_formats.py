"""Files of other formats handed to a reader: a torch.save file (zip and legacy), a DCP
checkpoint's ``.metadata``, another pickle, a gzip and a zip archive. ``load``, ``open``,
``verify``, ``read_metadata``, ``load_into``, the Lightning plug-in and the command all name
the format and say what to do (one recognition, in the reader), never "header length ...";
a damaged checkpoint is still corrupt, not taken for another format."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import cli
from tests.dcp.dcp_helpers import save_1

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _torch_save(path: Path) -> None:
    torch.save({"w": torch.randn(8, 4), "step": 3}, path)


def _torch_save_legacy(path: Path) -> None:
    torch.save({"w": torch.randn(8, 4)}, path, _use_new_zipfile_serialization=False)


def _dcp_metadata(path: Path) -> None:
    save_1({"w": torch.randn(8, 4)}, path.parent / "dcp")
    path.write_bytes((path.parent / "dcp" / ".metadata").read_bytes())


def _pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"w": torch.randn(8).tolist()}, protocol=4))


def _gzip(path: Path) -> None:  # a checkpoint, compressed: mtime 0 makes its first bytes a small "length"
    ckptstream.save({"w": torch.randn(8, 4)}, path.parent / "inner.safetensors")
    path.write_bytes(gzip.compress((path.parent / "inner.safetensors").read_bytes(), mtime=0))


def _zip(path: Path) -> None:
    ckptstream.save({"w": torch.randn(8, 4)}, path.parent / "inner.safetensors")
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(path.parent / "inner.safetensors", "inner.safetensors")


KINDS: dict[str, tuple[Callable[[Path], None], str, str, str]] = {  # writer, kind, what it is, what to do
    "torch_save": (_torch_save, "torch.save", "is a torch.save file, not a safetensors checkpoint",
                   "read it with torch.load"),
    "torch_save_legacy": (_torch_save_legacy, "torch.save", "is a torch.save file of the legacy (pickle) format",
                          "read it with torch.load"),
    "dcp_metadata": (_dcp_metadata, "DCP metadata", "is a DCP checkpoint's metadata, not a checkpoint file",
                     "storage_reader=ckptstream.dcp.StreamReader(folder)"),
    "pickle": (_pickle, "pickle", "is a Python pickle, not a safetensors checkpoint", "ckptstream reads no pickles"),
    "gzip": (_gzip, "gzip", "is a gzip-compressed file, not a safetensors checkpoint", "decompress it (gunzip)"),
    "zip": (_zip, "zip", "is a zip archive, not a safetensors checkpoint", "extract it"),
}
READERS: dict[str, Callable[[Path], Any]] = {
    "load": ckptstream.load,
    "open": lambda p: ckptstream.open(p).close(),
    "verify": ckptstream.verify,
    "read_metadata": ckptstream.read_metadata,
    "load_into": lambda p: ckptstream.load_into({"w": torch.zeros(8, 4)}, p),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("name", list(KINDS))
def test_every_reader_names_the_format(name: str, reader: str, tmp_path: Path) -> None:
    write, kind, what, advice = KINDS[name]
    path = tmp_path / "model.bin"
    write(path)
    with pytest.raises(ckptstream.NotACheckpointError) as e:
        READERS[reader](path)
    message = str(e.value)
    assert message.startswith(f"{path} {what}"), message
    assert advice in message
    assert "header length" not in message
    assert (e.value.kind, e.value.path) == (kind, str(path))
    assert isinstance(e.value, ckptstream.CorruptCheckpointError)  # what callers caught before
    assert isinstance(e.value.__cause__, ckptstream.CorruptCheckpointError)  # the header's own error, kept


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize("name", list(KINDS))
def test_the_command_names_the_format_and_exits_2(name: str, command: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    write, _, what, advice = KINDS[name]
    path = tmp_path / "model.bin"
    write(path)
    status = cli.main([command, str(path)])
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    assert err.startswith(f"ckptstream {command}: {path} {what}"), err
    assert advice in err
    assert "header length" not in err


def test_the_lightning_plug_in_says_what_to_do_with_a_torch_save_file(tmp_path: Path) -> None:
    from ckptstream.lightning import StreamCheckpointIO

    for write in (_torch_save, _torch_save_legacy):
        path = tmp_path / f"{write.__name__}.ckpt"
        write(path)
        with pytest.raises(ckptstream.NotACheckpointError) as e:
            StreamCheckpointIO().load_checkpoint(path)
        assert e.value.kind == "torch.save"
        assert str(e.value).startswith(f"{path} is a torch.save file (Lightning's default checkpoint format), not a "
                                       "ckptstream file: load it without StreamCheckpointIO, or convert it once")
    _gzip(tmp_path / "a.ckpt")
    with pytest.raises(ckptstream.NotACheckpointError, match="is a gzip-compressed file"):
        StreamCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")


def _header_of(length: int, data: bytes) -> bytes:
    """A safetensors file of one U8 tensor ``data`` whose header is ``length`` bytes long."""
    table = json.dumps({"x": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    return struct.pack("<Q", length) + table.ljust(length) + data


@pytest.mark.parametrize(("damage", "expected"), [
    ("length", "exceeds the 100000000-byte limit"),
    ("json", "header is not valid JSON"),
    ("pickle_like_length", "it is truncated"),  # its length, 640, is 80 02 00 ...: a pickle's first bytes
    ("gzip_like_length", "it is truncated"),  # 35615: 1f 8b 00 ...
])  # fmt: skip
def test_a_damaged_checkpoint_is_corrupt_not_another_format(damage: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save({"w": torch.randn(8, 4)}, path)
    raw = bytearray(path.read_bytes())
    if damage == "length":
        raw[5] = 0x40  # a header length past any limit
    elif damage == "json":
        raw[8] = ord("[")
    else:
        data = bytes(torch.randint(0, 256, (64,), dtype=torch.uint8).tolist())
        raw = bytearray(_header_of(640 if damage == "pickle_like_length" else 35615, data)[:-10])
        assert bytes(raw[:2]) in (b"\x80\x02", b"\x1f\x8b")
    path.write_bytes(bytes(raw))
    with pytest.raises(ckptstream.CorruptCheckpointError) as e:
        ckptstream.load(path)
    assert not isinstance(e.value, ckptstream.NotACheckpointError), e.value
    assert expected in str(e.value)
