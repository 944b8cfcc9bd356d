"""The google-cloud-storage client under ``gs://`` URLs: made by each storage the way Google's
client is configured (Application Default Credentials, ``GOOGLE_CLOUD_PROJECT``,
``STORAGE_EMULATOR_HOST``, where the client itself takes anonymous credentials), the requests
the library has no call for go through its session too (gcs.py: a part sent from memory, a
ranged GET read in place); its failures turned into typed errors that name the URL.
"""

from __future__ import annotations

import base64
import http.client
from typing import Any

from .._errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConnectionLostError,
    NoCredentialsError,
    ObjectNotFoundError,
    ObjectStoreError,
    ThrottledError,
)
from . import s3deadline
from .objclient import ObjectUrl


def b64(crc: int) -> str:
    """A CRC-32C as GCS's ``crc32c`` field spells it."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def make_client(options: dict[str, Any]) -> Any:
    """A ``google.cloud.storage.Client`` of the standard configuration (or ``options``, its
    keyword arguments), its connections watched by the deadlines of s3deadline."""
    from google.cloud import storage

    client = storage.Client(**options)
    # the connection classes go where urllib3 keeps them (requests has no public way)
    for adapter in client._http.adapters.values():
        manager = getattr(adapter, "poolmanager", None)
        if manager is not None:
            manager.pool_classes_by_scheme = _pool_classes()
    return client


def _pool_classes() -> dict[str, Any]:
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    def watched(base: Any) -> Any:
        class Watched(base):  # type: ignore[misc]
            def connect(self) -> None:
                s3deadline.watch(self)
                super().connect()

            def request(self, *args: Any, **kwargs: Any) -> Any:
                s3deadline.watch(self)
                return super().request(*args, **kwargs)

        return Watched

    class Pool(HTTPConnectionPool):
        ConnectionCls = watched(HTTPConnectionPool.ConnectionCls)

    class PoolTLS(HTTPSConnectionPool):
        ConnectionCls = watched(HTTPSConnectionPool.ConnectionCls)

    return {"http": Pool, "https": PoolTLS}


def no_bucket(url: ObjectUrl | str, what: str) -> BucketNotFoundError:
    bucket = url.bucket if isinstance(url, ObjectUrl) else str(url)
    return BucketNotFoundError(str(url), f"the bucket {bucket!r} does not exist ({what}); create it first, or check "
                               "the URL and STORAGE_EMULATOR_HOST", "NoSuchBucket")


_DENIED = {401, 403}
_THROTTLED = {429, 503}


def error(e: Exception, url: ObjectUrl | str, what: str) -> Exception:
    """The typed error for a failed request (``what``: the operation, for the message); other
    exceptions are returned as they are."""
    import requests
    from google.api_core import exceptions as gx
    from google.auth import exceptions as ax

    name = str(url)
    bucket = url.bucket if isinstance(url, ObjectUrl) else name
    if isinstance(e, ax.DefaultCredentialsError | ax.RefreshError):
        return NoCredentialsError(name, f"no credentials for {what} ({e}); run gcloud auth application-default "
                                  "login, or set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file")
    if isinstance(e, gx.NotFound) and "bucket does not exist" in str(e.message).lower():  # GCS's words
        return no_bucket(url, what)
    if isinstance(e, gx.GoogleAPICallError):
        code, text = int(e.code or 0), e.message
        if code == 404:
            return ObjectNotFoundError(name, f"no such object ({what})", "404")
        if code in _DENIED:
            return AccessDeniedError(name, f"access denied ({what}: {code}: {text}); check the credentials and "
                                     f"their permissions on the bucket {bucket!r}", str(code))
        if code in _THROTTLED:
            return ThrottledError(name, f"the store throttled {what} ({code}: {text}) through its retries; "
                                  "retry later", str(code))
        return ObjectStoreError(name, f"{what} failed ({code}: {text})", str(code))
    if isinstance(e, requests.RequestException | http.client.HTTPException | ConnectionError | TimeoutError):
        return ConnectionLostError(name, f"the connection to the store failed during {what} after every retry "
                                   f"({e}); check STORAGE_EMULATOR_HOST (if set) and the network")
    return e


def check(response: Any) -> Any:
    """The response, once it is no failure (else the library's typed exception of it)."""
    if response.status_code >= 400:
        from google.api_core import exceptions as gx

        failure = gx.from_http_response(response)  # (reads the small body of the answer)
        response.close()
        raise failure
    return response
