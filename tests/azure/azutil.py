"""Fixtures and helpers of the Azure tests: the session's Azurite (``azure_server``), a fresh
container per test reached through ``AZURE_STORAGE_CONNECTION_STRING`` (``azure``), and a raw
client to look at the container behind ckptstream's back. Test modules import the fixtures by
name; ``container_url`` gives any suite (the contract suite) a fresh ``az://`` URL."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstream._storage.azure import reset_clients
from tests.azure.azurite import AzuriteServer, require_azurite, shared_server

MiB = 1 << 20
# Azure configuration a test must not inherit from the machine it runs on
_FOREIGN = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY")


def reset_client() -> None:
    """Every Azure storage (also one a test module holds from an earlier registration) makes its
    client again from the variables as they are now."""
    reset_clients()


def use_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]) -> None:
    """Point Azure's variables (and nothing else of the machine's) at ``env``'s server; the upload
    journal goes under ``tmp_path``."""
    for name in _FOREIGN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    reset_client()


def container_url(server: AzuriteServer) -> str:
    """A new, empty container on ``server``, as the ``az://`` URL of its root."""
    name = f"ckpt-{uuid.uuid4().hex[:16]}"
    server.raw().create_container(name)
    return f"az://{name}/"


@dataclasses.dataclass
class Container:
    server: AzuriteServer
    name: str
    raw: Any  # a ContainerClient

    def url(self, key: str = "") -> str:
        return f"az://{self.name}/{key}"

    def get(self, key: str) -> bytes:
        data: bytes = self.raw.download_blob(key).readall()
        return data

    def put(self, key: str, data: bytes) -> None:
        self.raw.upload_blob(key, data, overwrite=True)

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(b.name for b in self.raw.list_blobs(name_starts_with=prefix or None))

    def uncommitted(self, key: str) -> list[str]:
        """The ids of the blob's staged blocks not (yet) committed."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            _, blocks = self.raw.get_blob_client(key).get_block_list("uncommitted")
        except ResourceNotFoundError:
            return []
        return [b.id for b in blocks]


@pytest.fixture(scope="session")
def azure_server() -> Iterator[AzuriteServer]:
    require_azurite()
    with shared_server() as server:
        yield server


@pytest.fixture
def azure(azure_server: AzuriteServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Container]:
    """A new, empty container on the session's Azurite, which ``az://`` URLs reach."""
    use_server(monkeypatch, tmp_path, azure_server.env)
    name = container_url(azure_server)[len("az://") : -1]
    yield Container(azure_server, name, azure_server.raw().get_container_client(name))
    reset_client()
