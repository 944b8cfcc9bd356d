"""Fixtures and helpers of the GCS tests: the session's emulator (``gcs_server``), a fresh bucket
per test reached through the standard variables (``gcs``), a raw client to look at the bucket
behind ckptstream's back, and ``fresh_bucket_url`` for suites that need only a URL."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstream._storage.gcs import HIDDEN, reset_clients
from tests.gcs.gcsserver import GCSServer, require_emulator, shared_server

MiB = 1 << 20
# the Google configuration a test must not inherit from the machine it runs on
_FOREIGN = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT",
            "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_UNIVERSE_DOMAIN")


def raw_client(env: dict[str, str]) -> Any:
    """A plain google-cloud-storage client of the emulator (what a person inspecting the bucket
    would use; it reads STORAGE_EMULATOR_HOST)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project=env["GOOGLE_CLOUD_PROJECT"], credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": env["STORAGE_EMULATOR_HOST"]})


@dataclasses.dataclass
class Bucket:
    server: GCSServer
    name: str
    raw: Any

    def url(self, key: str = "") -> str:
        return f"gs://{self.name}/{key}"

    def get(self, key: str) -> bytes:
        data: bytes = self.raw.bucket(self.name).blob(key).download_as_bytes()
        return data

    def put(self, key: str, data: bytes) -> None:
        self.raw.bucket(self.name).blob(key).upload_from_string(data)

    def all_keys(self, prefix: str = "") -> list[str]:
        return sorted(b.name for b in self.raw.list_blobs(self.name, prefix=prefix or None))

    def keys(self, prefix: str = "") -> list[str]:
        """The objects a user sees (those of uploads in flight left out)."""
        return [k for k in self.all_keys(prefix) if not k.startswith(HIDDEN)]

    def parts(self, key: str = "") -> list[str]:
        """The part objects of incomplete uploads under ``key``."""
        return self.all_keys(HIDDEN + key)


def use_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]) -> None:
    """Point the standard variables (and nothing else of the machine's) at ``env``'s emulator;
    the upload journal goes under ``tmp_path``."""
    for name in _FOREIGN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # none: no gcloud login of the machine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    reset_clients()


def new_bucket(server: GCSServer, raw: Any = None) -> Bucket:
    """A new bucket, without soft delete (GCS's default keeps deleted objects 7 days, and the
    emulator keeps them in its memory: every part a test removes would stay there); ``raw``, a
    raw client of the server, else one made for it."""
    raw = raw or raw_client(server.env)
    bucket = raw.bucket(f"ckpt-{uuid.uuid4().hex[:16]}")
    raw.create_bucket(bucket)
    bucket.soft_delete_policy.retention_duration_seconds = 0  # (the emulator takes it in a patch, not at creation)
    bucket.patch()
    return Bucket(server, bucket.name, raw)


def fresh_bucket_url(server: GCSServer, key: str = "") -> str:
    """``gs://`` URL of ``key`` in a new, empty bucket of ``server`` (for the contract suite)."""
    return new_bucket(server).url(key)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    require_emulator()
    with shared_server() as server:
        yield server


@pytest.fixture
def gcs(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Bucket]:
    """A new, empty bucket on the session's emulator, which ``gs://`` URLs reach."""
    use_server(monkeypatch, tmp_path, gcs_server.env)
    yield new_bucket(gcs_server)
    reset_clients()
