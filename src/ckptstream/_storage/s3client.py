"""The boto3 client under ``s3://`` URLs: made by each storage from the standard AWS configuration
(and the storage's own options), and its failures turned into typed errors that name the URL.

boto3 (botocore) is imported on the first URL, never by ``import ckptstream``. The endpoint,
region, credentials and retry policy come from where every AWS SDK looks: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``), ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ~/.aws/config and
~/.aws/credentials, ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``.
"""

from __future__ import annotations

import http.client
import os
from typing import Any

from .._errors import NoCredentialsError
from . import s3deadline
from .objclient import Failure, ObjectUrl, Words, answer_error, lost_error

# attempts per request where the configuration sets none: throttling and lost connections are
# retried with botocore's capped exponential backoff (standard mode), so a bounded wait
DEFAULT_ATTEMPTS = 6
POOL_CONNECTIONS = 64  # above the I/O threads of any transfer: a request never waits for a socket


def make_client(timeout: float, given: dict[str, Any]) -> Any:
    """A boto3 client whose sockets time out after ``timeout`` seconds, of the configuration
    where every AWS SDK looks, overridden by ``given`` (``boto3.client``'s keyword arguments:
    ``endpoint_url``, ``region_name``, ``aws_access_key_id``, ...). Its requests keep the
    deadlines of s3deadline."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    core = session._session
    retries: dict[str, Any] = {"mode": core.get_config_variable("retry_mode") or "standard"}
    if core.get_config_variable("max_attempts") is None:
        retries["max_attempts"] = DEFAULT_ATTEMPTS
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
    kwargs = {"region_name": os.environ.get("AWS_REGION") or None, **given}
    made = session.client("s3", config=Config(**options), **kwargs)
    chosen = core.get_config_variable("s3") or {}  # a profile's s3 settings: its choice stands
    if "payload_signing_enabled" not in chosen and not signs_payloads(str(made.meta.endpoint_url)):
        made = session.client("s3", config=Config(**options, s3={"payload_signing_enabled": False}), **kwargs)
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
WORDS = Words("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL", more=", or raise AWS_MAX_ATTEMPTS")


def error(e: Exception, url: ObjectUrl | str, what: str) -> Exception:
    """The typed error for a failed request (``what``: the operation, for the message); other
    exceptions are returned as they are."""
    from botocore import exceptions as bx

    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return NoCredentialsError(str(url), f"no credentials for {what} ({e}); set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials")
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        text = err.get("Message") or code
        attempts = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        failure: Failure = ("bucket" if code == "NoSuchBucket" else "object" if code in ("NoSuchKey", "404", "NotFound")
                            else "denied" if code in _DENIED else "throttled" if code in _THROTTLED else "other")
        return answer_error(url, what, failure, code, text, WORDS, f"{attempts + 1} attempts")
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectionClosedError | bx.ReadTimeoutError |
                  bx.ConnectTimeoutError | bx.ResponseStreamingError | bx.HTTPClientError |
                  http.client.HTTPException | ConnectionError | TimeoutError):  # the last: a body read in place
        return lost_error(url, what, e, WORDS)
    return e
