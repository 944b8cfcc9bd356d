"""The S3 client under ``s3://`` URLs: made once per process from the standard AWS configuration,
and its failures turned into typed errors that name the URL.

boto3 (botocore) is imported on the first URL, never by ``import ckptstream``. The endpoint,
region, credentials and retry policy come from where every AWS SDK looks: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``), ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ~/.aws/config and
~/.aws/credentials, ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``.
"""

from __future__ import annotations

import dataclasses
import http.client
import logging
import os
import threading
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

log = logging.getLogger(__name__)

SCHEME = "s3://"
# attempts per request where the configuration sets none: throttling and lost connections are
# retried with botocore's capped exponential backoff (standard mode), so a bounded wait
DEFAULT_ATTEMPTS = 6
POOL_CONNECTIONS = 64  # above the I/O threads of any transfer: a request never waits for a socket


@dataclasses.dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def child(self, key: str) -> S3Url:
        return S3Url(self.bucket, key)


def parse(url: str) -> S3Url:
    """``s3://bucket/key`` split; ValueError for what is not such a URL."""
    if not url.lower().startswith(SCHEME):
        raise ValueError(f"{url!r} is not an s3:// URL (s3://bucket/key)")
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: write s3://bucket/key")
    return S3Url(bucket, key)


_lock = threading.Lock()
_clients: dict[float, Any] = {}


def client() -> Any:
    """The process's S3 client for the ``s3_timeout`` in force, its sockets' timeout (botocore
    clients are thread-safe; sessions are not: one is made here, under a lock)."""
    timeout = s3deadline.limits().timeout
    with _lock:
        if timeout not in _clients:
            _clients[timeout] = _make_client(timeout)
        return _clients[timeout]


def reset_client() -> None:
    """Forget the clients: the next request makes one from the configuration as it is then."""
    with _lock:
        _clients.clear()


def request(url: S3Url, what: str, method: Any, /, *, nbytes: int = 0, limits: s3deadline.Limits | None = None,
            **kwargs: Any) -> Any:
    """``method(**kwargs)``, a request of ``nbytes`` bytes, held to its deadline (the settings in
    force, or ``limits``); its failure typed (``what``: the operation, for the message)."""
    with s3deadline.Deadline(url, what, nbytes, limits):
        try:
            return method(**kwargs)
        except Exception as e:
            raise error(e, url, what) from e


def _make_client(timeout: float) -> Any:
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    core = session._session
    retries: dict[str, Any] = {"mode": core.get_config_variable("retry_mode") or "standard"}
    if core.get_config_variable("max_attempts") is None:
        retries["max_attempts"] = DEFAULT_ATTEMPTS
    log.debug("S3 client: retries %s, %d connections, timeout %.1f s", retries, POOL_CONNECTIONS, timeout)
    options: dict[str, Any] = dict(
        max_pool_connections=POOL_CONNECTIONS,
        connect_timeout=timeout,
        read_timeout=timeout,
        retries=retries,
        # a checksum is sent where ckptstream gives one (CRC-32C per part), not computed again;
        # and responses are not checked against whole-object checksums, which some servers
        # return with a ranged GET (its bytes are checked against the header's CRC-32C instead)
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # AWS_REGION is the SDKs' common name; botocore itself reads AWS_DEFAULT_REGION and profiles
    region = os.environ.get("AWS_REGION") or None
    made = session.client("s3", region_name=region, config=Config(**options))
    chosen = core.get_config_variable("s3") or {}  # a profile's s3 settings: its choice stands
    if "payload_signing_enabled" not in chosen and not signs_payloads(str(made.meta.endpoint_url)):
        made = session.client("s3", region_name=region, config=Config(**options, s3={"payload_signing_enabled": False}))
    _bound(made)
    return made


def _bound(made: Any) -> None:
    """Hold the client's requests to their operations' deadlines (s3deadline): no attempt or
    retry past one, and connections the watchdog can shut down. The connection classes go in
    where botocore keeps them (no public way exists); where that place has moved, a deadline is
    still kept between attempts and between reads of a body, and a socket read by s3_timeout."""
    made.meta.events.register_first("before-send.s3", s3deadline.refuse_past_deadline,
                                    unique_id="ckptstream-deadline-send")
    made.meta.events.register_first("needs-retry.s3", s3deadline.no_retry_past_deadline,
                                    unique_id="ckptstream-deadline-retry")
    classes = getattr(getattr(getattr(made, "_endpoint", None), "http_session", None), "_pool_classes_by_scheme", None)
    if isinstance(classes, dict):
        classes.update(s3deadline.pool_classes())  # the pool managers share this dict; pools are made later


def signs_payloads(endpoint: str) -> bool:
    """Whether request bodies are signed (hashed with SHA-256 into the signature): over plain
    HTTP, where nothing else protects them in transit. Over TLS they are not, as botocore does
    for the checksums it computes itself (TLS and a checksum are its rule): botocore would hash
    every part once more only because ckptstream, not botocore, computed its CRC-32C."""
    return not endpoint.lower().startswith("https://")


_DENIED = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
           "InvalidToken", "ExpiredToken", "InvalidSecurity", "AccountProblem"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
              "RequestThrottled", "503", "ServiceUnavailable", "429"}


def error(e: Exception, url: S3Url | str, what: str) -> Exception:
    """The typed error for a failed request (``what``: the operation, for the message); other
    exceptions are returned as they are."""
    from botocore import exceptions as bx

    name = str(url)
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return NoCredentialsError(name, f"no credentials for {what} ({e}); set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials")
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        text = err.get("Message") or code
        attempts = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        bucket = url.bucket if isinstance(url, S3Url) else name
        if code == "NoSuchBucket":
            return BucketNotFoundError(name, f"the bucket {bucket!r} does not exist ({what}); create it first, or "
                                       "check the URL and AWS_ENDPOINT_URL", code)
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFoundError(name, f"no such object ({what})", code)
        if code in _DENIED:
            return AccessDeniedError(name, f"access denied ({what}: {code}: {text}); check the credentials and "
                                     f"their permissions on the bucket {bucket!r}", code)
        if code in _THROTTLED:
            return ThrottledError(name, f"the store throttled {what} ({code}: {text}) through {attempts + 1} "
                                  "attempts; retry later, or raise AWS_MAX_ATTEMPTS", code)
        return ObjectStoreError(name, f"{what} failed ({code}: {text})", code)
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectionClosedError | bx.ReadTimeoutError |
                  bx.ConnectTimeoutError | bx.ResponseStreamingError | bx.HTTPClientError |
                  http.client.HTTPException | ConnectionError | TimeoutError):  # the last: a body read in place
        return ConnectionLostError(name, f"the connection to the store failed during {what} after every retry "
                                   f"({e}); check AWS_ENDPOINT_URL and the network")
    return e
