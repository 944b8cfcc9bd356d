"""Fixtures and hooks of the test suite (the helpers are in helpers.py).

- ``device``: every test taking it runs on ``cpu`` and, marked ``gpu``, on ``cuda``;
- one collection hook skips ``gpu``-marked tests where torch sees no CUDA device;
- ``direct_io``: a test runs under each O_DIRECT mode; ``jitter``: I/O threads finish out of order;
- ``mem``: an in-memory storage served for ``mem://`` URLs; ``place``: a test runs on every
  storage of ``tests/storages.py`` (the local file system, that storage, and the object stores
  through the real servers of their suites, one each for the session: S3 through the
  ``rclone serve s3`` of tests/s3, GCS through the gcp-storage-emulator of tests/gcs, Azure Blob
  Storage through the Azurite of tests/azure);
- every test draws its random data from a seed of its own.
"""

from __future__ import annotations

import importlib.util
import random
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import DirectIO
from ckptstream._storage import fileio, register
from tests.azure.azutil import azure_server  # noqa: F401  (a fixture: the Azure target of ``place``)
from tests.gcs.gcsutil import gcs_server  # noqa: F401  (a fixture: the GCS target of ``place``)
from tests.helpers import CUDA, READ_CALLS, direct_io_supported
from tests.memstore import MemStorage
from tests.s3.s3util import s3_server  # noqa: F401  (a fixture: the S3 target of ``place``)
from tests.storages import Place, Target, mark_differences, params

# the object-store suites and the client libraries they import at collection
_CLIENTS = {"s3": ("boto3",), "gcs": ("boto3", "google.cloud.storage"), "azure": ("boto3", "azure.storage.blob")}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m gpu`` (a GPU machine may lack the object-store extras, and no such suite has
    a GPU test) a suite whose client library is missing is not collected; elsewhere it fails to
    collect, so that a test environment without a test dependency fails loudly."""
    clients = _CLIENTS.get(collection_path.name) if collection_path.parent == Path(__file__).parent else None
    if clients is None or config.getoption("markexpr") != "gpu":
        return None
    return any(_missing(name) for name in clients) or None


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``gpu`` (the ``cuda`` half of the ``device`` fixture included) where
    torch sees no CUDA device; mark what a storage is known not to keep (``Target.differs``)."""
    for item in items:
        mark_differences(item)
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Random data in every test, reproducible per test whatever runs before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=[DirectIO.OFF, DirectIO.ON, DirectIO.AUTO], ids=["buffered", "direct", "auto"])
def direct_io(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DirectIO]:
    """Runs the test under ``ckptstream.settings(direct_io=...)`` for each mode."""
    if request.param is DirectIO.ON and not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    with ckptstream.settings(direct_io=request.param):
        yield request.param


@pytest.fixture
def mem() -> Iterator[MemStorage]:
    """A fresh in-memory storage, serving ``mem://`` URLs for the test."""
    store = MemStorage()
    register("mem", lambda: store)
    try:
        yield store
    finally:
        register("mem", None)


@pytest.fixture(params=params())
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """Where the test's files live: a fresh, empty folder of each storage of ``TARGETS``."""
    target: Target = request.param
    return target.make(request, tmp_path)


@pytest.fixture
def jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short random sleeps before every pwrite/pread, so that I/O threads finish out of order."""
    rng = random.Random(1234)

    def delayed(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            time.sleep(rng.random() * 3e-4)
            return real(*args)
        return call

    for name in ("pwrite_all", *READ_CALLS):
        monkeypatch.setattr(fileio, name, delayed(getattr(fileio, name)))


@pytest.fixture
def no_save_left_behind() -> Iterator[None]:
    """Every test ends with no background save in flight and no error left for the next test
    (the modules of background saves use it for every test)."""
    from ckptstream._checkpoint import save_async

    yield
    for handle in save_async.in_flight():
        handle._done.wait(30)
    leftover = list(save_async._uncollected)
    save_async._uncollected.clear()
    assert leftover == [], f"a test left failed saves nobody collected: {leftover}"
