"""The google-cloud-storage client under ``gs://`` URLs: made by each storage the way Google's
client is configured (Application Default Credentials, ``GOOGLE_CLOUD_PROJECT``,
``STORAGE_EMULATOR_HOST``, where the client itself takes anonymous credentials), the requests
the library has no call for go through its session too (gcs.py: a part sent from memory, a
ranged GET read in place); its failures turned into typed errors that name the URL.
"""

from __future__ import annotations

import http.client
from typing import Any

from .._errors import NoCredentialsError
from . import s3deadline
from .objclient import Failure, ObjectUrl, Words, answer_error, lost_error

WORDS = Words("STORAGE_EMULATOR_HOST", "STORAGE_EMULATOR_HOST (if set)")


def make_client(options: dict[str, Any]) -> Any:
    """A ``google.cloud.storage.Client`` of the standard configuration (or ``options``, its
    keyword arguments), its connections watched by the deadlines of s3deadline."""
    from google.cloud import storage

    client = storage.Client(**options)
    s3deadline.watch_session(client._http)
    return client


_DENIED = {401, 403}
_THROTTLED = {429, 503}


def error(e: Exception, url: ObjectUrl | str, what: str) -> Exception:
    """The typed error for a failed request (``what``: the operation, for the message); other
    exceptions are returned as they are."""
    import requests
    from google.api_core import exceptions as gx
    from google.auth import exceptions as ax

    if isinstance(e, ax.DefaultCredentialsError | ax.RefreshError):
        return NoCredentialsError(str(url), f"no credentials for {what} ({e}); run gcloud auth application-default "
                                  "login, or set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file")
    if isinstance(e, gx.NotFound) and "bucket does not exist" in str(e.message).lower():  # GCS's words
        return answer_error(url, what, "bucket", "NoSuchBucket", "", WORDS)
    if isinstance(e, gx.GoogleAPICallError):
        code = int(e.code or 0)
        failure: Failure = ("object" if code == 404 else "denied" if code in _DENIED
                            else "throttled" if code in _THROTTLED else "other")
        return answer_error(url, what, failure, str(code), e.message, WORDS)
    if isinstance(e, requests.RequestException | http.client.HTTPException | ConnectionError | TimeoutError):
        return lost_error(url, what, e, WORDS)
    return e


def check(response: Any) -> Any:
    """The response, once it is no failure (else the library's typed exception of it)."""
    if response.status_code >= 400:
        from google.api_core import exceptions as gx

        failure = gx.from_http_response(response)  # (reads the small body of the answer)
        response.close()
        raise failure
    return response
