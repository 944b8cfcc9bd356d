"""Test helpers: random data, poisoned destinations, byte-exact comparison, the table of
edge-case tensors, file and header probes, failure injection and leak checks.

Test modules import them from the ``tests`` package (``from tests.helpers import EDGE_CASES,
poison, ...``); child processes find it through ``child_env``. Fixtures and hooks live in
conftest.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import mmap
import os
import signal
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import _checksum
from ckptstream._engine import Piece, copyable
from ckptstream._engine.buffers import POOL
from ckptstream._format import header as _header

CUDA = torch.cuda.is_available()
POISON_BYTE = 0xAB  # never produced by random_bytes, so an unwritten byte always shows
KiB, MiB = 1 << 10, 1 << 20

# --- random data ----------------------------------------------------------------------------


def random_bytes(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` random bytes (uint8) that never equal POISON_BYTE."""
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    b[b == POISON_BYTE] = POISON_BYTE ^ 0xFF
    return b


_NORMAL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}


def random_tensor(shape: tuple[int, ...] | int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """A contiguous tensor of random values: normal floats, random bit patterns for integer and
    8-bit float dtypes, random True/False for bool."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device).bool()
    if dtype in _NORMAL_DTYPES:
        return torch.randn(shape, dtype=dtype, device=device)
    esz = torch.empty((), dtype=dtype).element_size()
    return random_bytes(math.prod(shape) * esz, device).view(dtype).reshape(shape)


# --- poison and byte comparison -------------------------------------------------------------


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` (contiguous or a non-overlapping view) with POISON_BYTE bytes; returns ``t``."""
    if t.is_contiguous():
        t.reshape(-1).view(torch.uint8).fill_(POISON_BYTE)
    else:
        t.copy_(poison(torch.empty(t.shape, dtype=t.dtype, device=t.device)))
    return t


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous poisoned tensor with ``t``'s shape, dtype and device."""
    return poison(torch.empty(t.shape, dtype=t.dtype, device=t.device))


def is_poisoned(t: torch.Tensor) -> bool:
    """Whether every byte of ``t`` is still POISON_BYTE."""
    return bool(t.detach().contiguous().reshape(-1).view(torch.uint8).eq(POISON_BYTE).all())


def as_bytes(t: torch.Tensor) -> bytes:
    """The logical row-major bytes of ``t`` (what ``t.contiguous()`` holds), on the host."""
    src = copyable(t.detach())
    fresh = torch.empty(src.shape, dtype=src.dtype).copy_(src)  # fresh strides: size-1 dims may carry any
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def packed_pieces(tensors: list[torch.Tensor], start: int) -> list[Piece]:
    """Pieces of ``tensors`` back to back in a file, from byte ``start``."""
    pieces, offset = [], start
    for t in tensors:
        pieces.append(Piece.of(t, offset))
        offset += nbytes(t)
    return pieces


def assert_bytes_equal(actual: torch.Tensor | bytes, expected: torch.Tensor | bytes) -> None:
    """Byte-exact comparison (NaN payloads, -0.0 and invalid bools included), with a short
    message naming the first differing byte instead of a dump."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype)
    a = actual if isinstance(actual, bytes) else as_bytes(actual)
    e = expected if isinstance(expected, bytes) else as_bytes(expected)
    if a != e:
        first = next((i for i, (x, y) in enumerate(zip(a, e, strict=False)) if x != y), min(len(a), len(e)))
        still_poison = sum(1 for x in a if x == POISON_BYTE)
        pytest.fail(f"bytes differ: {len(a)} vs {len(e)} bytes, first difference at byte {first} "
                    f"({a[first:first + 8].hex()} vs {e[first:first + 8].hex()}); {still_poison} poison bytes left")


# --- the edge-case table --------------------------------------------------------------------


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclasses.dataclass(frozen=True)
class EdgeCase:
    """A tensor to stream: ``view`` of a random contiguous base of ``shape`` and ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: Callable[[torch.Tensor], torch.Tensor] = _same
    writable: bool = True  # False: the view's elements share memory (expand); not a destination

    def source(self, device: torch.device | str) -> torch.Tensor:
        return self.view(random_tensor(self.shape, self.dtype, device))

    def destination(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A poisoned base and the view of it to read into (check the base's bytes outside the
        view stay poisoned with ``expected_base``)."""
        base = poison(torch.empty(self.shape, dtype=self.dtype, device=device))
        return base, self.view(base)

    def expected_base(self, src: torch.Tensor) -> torch.Tensor:
        """What a destination base holds after a correct read of ``src``."""
        base = poison(torch.empty(self.shape, dtype=self.dtype, device=src.device))
        copyable(self.view(base)).copy_(copyable(src))
        return base


def _optional_dtypes(*names: str) -> list[torch.dtype]:
    return [getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    *_optional_dtypes("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                      "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"),
]


def needs_dtype(name: str, since: str) -> pytest.MarkDecorator:
    """Skip where torch has no ``torch.<name>`` (added in torch ``since``)."""
    return pytest.mark.skipif(not hasattr(torch, name), reason=f"torch {torch.__version__} has no {name} ({since}+)")


FLOAT4: torch.dtype | None = getattr(torch, "float4_e2m1fn_x2", None)  # safetensors' F4
needs_float4 = needs_dtype("float4_e2m1fn_x2", "2.8")
needs_e8m0 = needs_dtype("float8_e8m0fnu", "2.7")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


EDGE_CASES = [
    EdgeCase("0d", (), torch.float32),
    EdgeCase("0d_view_into_storage", (10,), torch.float64, lambda t: t[3]),
    EdgeCase("empty", (0,), torch.float32),
    EdgeCase("empty_2d", (3, 0), torch.int64),
    EdgeCase("one_byte", (1,), torch.uint8),
    EdgeCase("odd_bytes_7", (7,), torch.int8),
    EdgeCase("odd_bytes_4097", (4097,), torch.uint8),
    EdgeCase("odd_bytes_fp8_3x5", (3, 5), torch.float8_e4m3fn),
    EdgeCase("odd_bytes_bool_13", (13,), torch.bool),
    *[EdgeCase(f"dtype_{dtype_name(d)}", (7, 5), d) for d in DTYPES],
    EdgeCase("view_into_larger_storage", (100,), torch.float32, lambda t: t[37:91]),
    EdgeCase("transpose", (33, 17), torch.float32, lambda t: t.t()),
    EdgeCase("transpose_fp8", (9, 7), torch.float8_e5m2, lambda t: t.t()),
    EdgeCase("transpose_complex", (6, 5), torch.complex64, lambda t: t.t()),
    EdgeCase("permute_3d_bf16", (5, 7, 3), torch.bfloat16, lambda t: t.permute(2, 0, 1)),
    EdgeCase("strided_slice", (40, 30), torch.float16, lambda t: t[::3, 1::2]),
    EdgeCase("step_1d", (1000,), torch.int32, lambda t: t[::7]),
    EdgeCase("column", (50, 9), torch.uint8, lambda t: t[:, 4]),
    EdgeCase("window_odd_bytes", (20, 20), torch.uint8, lambda t: t[3:16, 5:12]),
    EdgeCase("bool_every_other", (31,), torch.bool, lambda t: t[1::2]),
    EdgeCase("expanded", (1, 13), torch.float64, lambda t: t.expand(9, 13), writable=False),
    EdgeCase("expanded_middle", (4, 1, 6), torch.int16, lambda t: t.expand(4, 5, 6), writable=False),
]
EDGE_CASE_NAMES = [c.name for c in EDGE_CASES]
WRITABLE_EDGE_CASES = [c for c in EDGE_CASES if c.writable]


def edge_case_tensors(device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """(name, random tensor) for every edge case, on ``device``."""
    return [(c.name, c.source(device)) for c in EDGE_CASES]


# --- files ----------------------------------------------------------------------------------


def header_of(path: Path | str) -> tuple[int, dict[str, Any]]:
    """The absolute offset of the data section and the parsed JSON header of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def flip_last_byte(path: Path, key: str) -> None:
    """Corrupt one bit of the last byte of the stored tensor ``key`` of a safetensors file."""
    raw = bytearray(path.read_bytes())
    start, table = header_of(path)
    raw[start + table[key]["data_offsets"][1] - 1] ^= 0x01
    path.write_bytes(bytes(raw))


def direct_io_supported(directory: Path) -> bool:
    """Whether the file system under ``directory`` accepts an aligned O_DIRECT write (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / ".o_direct_probe"
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, 4096) as block:
            os.pwrite(fd, block, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


# --- failure injection ----------------------------------------------------------------------


def fail_on_call(k: int, real: Callable[..., Any], exc: Callable[[str], BaseException]) -> Callable[..., Any]:
    """``real``, except that its k-th call (1-based, counted over all threads) raises ``exc(path)``."""
    calls = itertools.count(1)
    lock = threading.Lock()

    def call(*args: Any) -> Any:
        with lock:
            n = next(calls)
        if n == k:
            raise exc(args[3])  # the storage.fileio primitives take (fd, view(s), offset, path, ...)
        return real(*args)
    return call


# The calls that read file data into memory: staged chunks are read with pread_into, chunks of
# host tensors straight into them with preadv_all.
READ_CALLS = ("pread_into", "preadv_all")


# --- leak checks ----------------------------------------------------------------------------


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what they point to."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # listdir's own descriptor is gone by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


# the process's one S3 deadline watchdog: made at the first S3 request, asleep on a condition,
# holding nothing (``_storage/s3deadline.py``)
WATCHDOG = "ckptstream-s3-deadlines"


def engine_threads() -> list[threading.Thread]:
    """Threads of ckptstream's engines still alive (they are named ``ckptstream-...``)."""
    return [t for t in threading.enumerate() if t.name.startswith("ckptstream") and t.name != WATCHDOG]


@dataclasses.dataclass
class Resources:
    """What a transfer may hold: descriptors, staging buffers, threads. Take the snapshot after
    a first transfer on the device, so that lazily opened driver descriptors do not count."""

    fds: dict[int, str]
    pool_in_use: int

    @classmethod
    def snapshot(cls) -> Resources:
        return cls(open_fds(), POOL.in_use)

    def assert_released(self) -> None:
        """No engine thread alive, every staging buffer back in the pool, no new descriptor of a
        file (devices, pipes and sockets a CUDA driver may open lazily do not count)."""
        assert engine_threads() == []
        assert POOL.in_use == self.pool_in_use == 0
        leaked = {fd: target for fd, target in open_fds().items()
                  if self.fds.get(fd) != target and target.startswith("/") and not target.startswith("/dev/")}
        assert leaked == {}


def fail_kth_call(monkeypatch: pytest.MonkeyPatch, owner: Any, names: tuple[str, ...], k: int,
                  exc: Callable[[], BaseException], *, after: bool = False) -> None:
    """Make the k-th call (1-based, over all threads) of any of ``owner.<name>`` raise ``exc()``;
    with ``after``, once the real call has returned (its work done, e.g. copies enqueued)."""
    calls = itertools.count(1)
    lock = threading.Lock()

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                n = next(calls)
            if n == k and not after:
                raise exc()
            result = real(*args, **kwargs)
            if n == k:
                raise exc()
            return result
        return call

    for name in names:
        monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))


def craft_checkpoint(path: Path, tensors: list[tuple[str, str, list[int], bytes]], structure: str,
                     metadata: dict[str, str] | None = None) -> Path:
    """A ckptstream file written by hand (any structure text; non-ASCII escaped as JSON does)
    whose tensor and header checksums are right, so that only the structure's own checks stand
    between it and a load."""
    meta = {**(metadata or {}), "ckptstream.format": "1", "ckptstream.structure": structure,
            "ckptstream.crc32c": "0" * 8 * len(tensors), "ckptstream.header_crc32c": "0" * 8}
    table: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for name, dtype, shape, data in tensors:
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    body = json.dumps(table, separators=(",", ":"), ensure_ascii=True).encode()
    header = _header.fill(struct.pack("<Q", len(body)) + body, [_checksum.crc_of(d) for *_, d in tensors])
    path.write_bytes(header + b"".join(d for *_, d in tensors))
    return path


def spy_on_staging(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(buffer size, count) of every request for staging buffers from now on."""
    taken: list[tuple[int, int]] = []
    real = POOL.acquire

    def spy(size: int, count: int, pinned: bool) -> Any:
        taken.append((size, count))
        return real(size, count, pinned)

    monkeypatch.setattr(POOL, "acquire", spy)
    return taken


def assert_same_state(actual: Any, expected: Any, where: str = "state", device: str | None = None) -> None:
    """Equal containers (types, key order and key types), leaves, tensors (dtype, shape, bytes;
    on ``device``'s type, if given)."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert device is None or actual.device.type == device, where
        assert_bytes_equal(actual, expected)
    elif isinstance(expected, dict):
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], where
        for k in expected:
            assert_same_state(actual[k], expected[k], f"{where}.{k}", device)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{where}.{i}", device)
    else:
        assert actual == expected, where


# --- child processes ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]  # of the repository: the ``tests`` package is found from it
SRC = Path(ckptstream.__file__).resolve().parents[1]  # of the package under test


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process: this one, with the package under test and the
    ``tests`` package first on the path, and one OpenMP thread unless set (small models: threads
    only contend on a small CI machine); ``extra`` last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def buffers(buffer_size: int | None, num_buffers: int | None = None) -> ckptstream.Settings:
    """The settings of a test parametrised over staging buffers: the defaults but for these
    (None: the default)."""
    default = ckptstream.Settings()
    return ckptstream.Settings(buffer_size=buffer_size or default.buffer_size,
                               num_buffers=num_buffers or default.num_buffers)


def needs_ctrl_c() -> None:
    """Skip the calling test where SIGINT is not handled by Python's default handler: a shell
    starts a background job (and ``nohup`` a command) with SIGINT ignored, which the test's
    children inherit too, so a Ctrl-C the test sends (a SIGINT, ``_thread.interrupt_main``)
    raises no KeyboardInterrupt there."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not handled by Python's default handler here (ignored, as in a background job or "
                    "under nohup, or replaced), so a Ctrl-C raises no KeyboardInterrupt")
