"""Errors that name the key and say what to do, for what a state or a call can get wrong:
tensors that cannot be stored (nested, quantized, DTensor, other subclasses), text that UTF-8
cannot encode, ``bytes`` paths (which work like ``str``), and devices ckptstream cannot load to
("meta" reads the structure only)."""

from __future__ import annotations

import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream._errors import UnsupportedTypeError
from tests.memstore import MemStorage

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _quiet(make: Any) -> Any:
    """``make()`` with torch's prototype warnings (nested, quantized tensors) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def _refused(state: Any, path: Path, *, metadata: dict[str, str] | None = None) -> str:
    """Save ``state``, expecting an UnsupportedTypeError before any file is made; its message."""
    with pytest.raises(UnsupportedTypeError) as e:
        ckptstream.save(state, path, metadata=metadata)
    assert not path.exists()
    assert os.listdir(path.parent) == []
    return str(e.value)


# --- tensors that cannot be stored ----------------------------------------------------------


def test_strided_nested_tensor_names_the_key(tmp_path: Path) -> None:
    nested = _quiet(lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]))
    assert nested.layout == torch.strided
    message = _refused({"model": {"ragged": nested}}, tmp_path / "c")
    assert message.startswith("model.ragged: a nested tensor")
    assert "unbind" in message
    assert "Internal error" not in message


def test_jagged_nested_tensor_is_called_nested_not_a_subclass(tmp_path: Path) -> None:
    nested = _quiet(lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged))
    message = _refused({"batch": [nested]}, tmp_path / "c")
    assert message.startswith("batch.0: a nested tensor")
    assert "subclass" not in message
    assert ".detach()" not in message


def test_quantized_tensor_says_quantized(tmp_path: Path) -> None:
    q = _quiet(lambda: torch.quantize_per_tensor(torch.randn(6), 0.1, 3, torch.qint8))
    message = _refused({"layer": {"qweight": q}}, tmp_path / "c")
    assert message.startswith("layer.qweight: a quantized tensor")
    assert "int_repr" in message
    assert "strided" not in message


def test_sparse_tensor_says_to_dense(tmp_path: Path) -> None:
    message = _refused({"s": torch.randn(3, 3).to_sparse()}, tmp_path / "c")
    assert message.startswith("s: a torch.sparse_coo tensor")
    assert "to_dense()" in message


class _Tagged(torch.Tensor):
    """A tensor subclass of the kind libraries define (no __torch_dispatch__ of its own)."""


def test_other_tensor_subclass_gets_no_detach_advice(tmp_path: Path) -> None:
    t = torch.randn(4).as_subclass(_Tagged)
    assert type(t.detach()) is _Tagged  # why .detach() is no advice: it keeps the subclass
    message = _refused({"w": t}, tmp_path / "c")
    assert message.startswith("w: tensor subclass _Tagged is not supported")
    assert ".detach()" not in message
    assert "as_subclass(torch.Tensor)" in message


@pytest.fixture
def gloo_group(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:DTensor random operators:UserWarning")  # torch 2.4, on a CPU mesh
def test_dtensor_points_to_the_distributed_backend(gloo_group: Any, tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import Shard, distribute_tensor  # type: ignore[attr-defined]

    dt = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    (tmp_path / "out").mkdir()
    message = _refused({"model": {"w": dt}, "step": 3}, tmp_path / "out" / "c")
    assert message.startswith("model.w: a DTensor")
    assert "ckptstream.dcp" in message
    assert ".detach()" not in message


# --- text UTF-8 cannot encode ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["key", "nested_key", "str_leaf", "tuple_leaf"])
def test_lone_surrogate_in_the_state_names_the_key(where: str, tmp_path: Path) -> None:
    bad = "caf\udce9"  # what os.fsdecode makes of a Latin-1 byte
    state, key = {
        "key": ({bad: torch.randn(2)}, repr(bad)),
        "nested_key": ({"model": {bad: torch.randn(2)}}, repr(f"model.{bad}")),
        "str_leaf": ({"run": {"name": bad}}, "'run.name'"),
        "tuple_leaf": ({"tags": ("ok", bad)}, "'tags.1'"),
    }[where]
    message = _refused(state, tmp_path / "c")
    assert message.startswith(key)
    assert "UTF-8" in message
    assert "surrogates not allowed" in message


@pytest.mark.parametrize("where", ["metadata_key", "metadata_value"])
def test_lone_surrogate_in_metadata_is_a_value_error_naming_it(where: str, tmp_path: Path) -> None:
    metadata = {"caf\udce9": "v"} if where == "metadata_key" else {"note": "caf\udce9"}
    with pytest.raises(ValueError, match="UTF-8 cannot encode") as e:
        ckptstream.save({"w": torch.randn(2)}, tmp_path / "c", metadata=metadata)
    assert type(e.value) is not UnicodeEncodeError
    assert repr(next(iter(metadata))) in str(e.value)
    assert "UTF-8" in str(e.value)
    assert os.listdir(tmp_path) == []


# --- bytes paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [b"ckpt.safetensors", b"caf\xe9.safetensors"], ids=["ascii", "latin1_byte"])
def test_bytes_paths_work_like_str(name: bytes, tmp_path: Path) -> None:
    path: Any = os.path.join(os.fsencode(tmp_path), name)  # the signatures name str paths; bytes work too
    w, b = torch.randn(5, 3), torch.randn(3)
    state = {"model": {"w": w, "b": b}, "step": 11}
    ckptstream.save(state, path, metadata={"run": "x"})
    assert os.listdir(os.fsencode(tmp_path)) == [name]  # no temp left, the very name
    for back in (ckptstream.load(path), ckptstream.load(os.fsdecode(path))):
        assert back["step"] == 11
        assert torch.equal(back["model"]["w"], w)
    ckptstream.verify(path)
    assert ckptstream.read_metadata(path) == {"run": "x"}
    with ckptstream.open(path) as reader:
        assert reader.path == os.fsdecode(path)
        assert torch.equal(reader.read("model.b"), b)
    target_w = torch.empty(5, 3)
    ckptstream.load_into({"model": {"w": target_w, "b": torch.empty(3)}, "step": 0}, path)
    assert torch.equal(target_w, w)
    ckptstream.save({"w": torch.randn(2)}, path)  # over an existing file, too
    assert list(ckptstream.load(path)) == ["w"]


# --- devices --------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    t = torch.randn(64, 1024)
    # with "big", more data than the one read of the header takes in (1 MiB): data reads show
    state = {"model": {"w": t, "row": t[3], "cols": t[:, :5], "big": torch.randn(300_000)},
             "optim": [{"step": 4, "lr": 0.5}], "name": "run"}
    path = tmp_path / "ckpt.safetensors"
    ckptstream.save(state, path)
    return path, state


@pytest.mark.skipif(CUDA, reason="checks the message of a build or machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_value_error(device: Any, saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    with pytest.raises(ValueError, match="torch sees no CUDA device") as e:
        ckptstream.load(path, device=device)
    assert not isinstance(e.value, AssertionError)
    with ckptstream.open(path) as reader:
        with pytest.raises(ValueError, match="no CUDA device"):
            reader.read("model.w", device=device)
        with pytest.raises(ValueError, match="no CUDA device"):
            reader.read_slices([("model.w", [0, 0], [2, 2], device)])[0]


@pytest.mark.parametrize("device", ["xpu", "mps", "bogus", "cuda:x", torch.device("meta")])
def test_unknown_device_types_are_value_errors(device: Any, saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    with ckptstream.open(path) as reader, pytest.raises(ValueError, match=r"device=.*'cpu' or 'cuda'"):
        reader.read("model.w", device=device)
    if device != torch.device("meta"):
        with pytest.raises(ValueError, match=r"device=.*'cpu' or 'cuda'"):
            ckptstream.load(path, device=device)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_meta_device_gives_the_structure_and_reads_no_data(device: Any, mem: MemStorage) -> None:
    """Every read of the storage (in memory, which notes each one's offset and length)."""
    t = torch.randn(64, 1024)
    state: dict[str, Any] = {"model": {"w": t, "row": t[3], "cols": t[:, :5], "big": torch.randn(300_000)},
             "optim": [{"step": 4, "lr": 0.5}], "name": "run"}
    path, reads = "mem://test/ckpt.safetensors", mem.reads
    ckptstream.save(state, path)
    with ckptstream.open(path) as reader:
        data_start = reader.header.data_start
    reads.clear()
    back = ckptstream.load(path, device=device)
    data_reads = [r for r in reads if r[0] >= data_start]
    assert data_reads == []
    assert len(reads) == 1
    assert reads[0][0] == 0
    assert back["optim"] == [{"step": 4, "lr": 0.5}]
    assert back["name"] == "run"
    for key, t in state["model"].items():
        got = back["model"][key]
        assert (got.device.type, got.dtype, got.shape, got.stride()) == ("meta", t.dtype, t.shape, t.stride())
    # the views still share their (meta) storage
    assert back["model"]["row"].untyped_storage().nbytes() == back["model"]["w"].untyped_storage().nbytes()

    reads.clear()  # the counter sees the reads of a real load
    ckptstream.load(path)
    assert sum(n for offset, n in reads if offset >= data_start) > 0


# --- ints JSON text cannot carry back -------------------------------------------------------


@pytest.mark.parametrize("where", ["leaf", "key"])
def test_an_int_too_long_for_json_names_the_key(where: str, tmp_path: Path) -> None:
    huge = 10**5000  # Python refuses to turn it into text (or back) past 4300 digits
    state = {"run": {"seed": huge}} if where == "leaf" else {"run": {huge: 1}}
    message = _refused(state, tmp_path / "c")
    assert message.startswith("run.seed: an int" if where == "leaf" else "run: a dict key: an int")
    assert "too long" in message
    assert "store it as a str" in message


def test_long_ints_within_the_limit_round_trip(tmp_path: Path) -> None:
    state = {"a": 2**14000 - 1, "b": -(10**4000), "keys": {2**13999: "k", -(2**200): "m"}, "w": torch.randn(2)}
    ckptstream.save(state, tmp_path / "c")
    back = ckptstream.load(tmp_path / "c")
    assert (back["a"], back["b"], back["keys"]) == (state["a"], state["b"], state["keys"])


# --- where the exceptions live --------------------------------------------------------------


def test_every_public_exception_is_defined_in_the_errors_module() -> None:
    """One hierarchy in one module: every exception and warning the public API exports (the
    package, ``dcp``, ``lightning``) is a class of ``ckptstream._errors``, re-exported."""
    import ckptstream.dcp
    import ckptstream.lightning

    found = {}
    for module in (ckptstream, ckptstream.dcp, ckptstream.lightning):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[f"{module.__name__}.{name}"] = value.__module__
    assert {"ckptstream.ExportError", "ckptstream.DirectoryLockedError", "ckptstream.CheckpointTimeoutError",
            "ckptstream.SnapshotFallbackWarning", "ckptstream.lightning.StorageOptionsError"} <= set(found)
    assert {k: v for k, v in found.items() if v != "ckptstream._errors"} == {}
