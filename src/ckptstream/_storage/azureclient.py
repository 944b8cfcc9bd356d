"""The azure-storage-blob client under ``az://`` URLs: made by each storage from the variables
Azure's own tools read, and its failures turned into typed errors that name the URL.

azure-storage-blob is imported on the first URL, never by ``import ckptstream``. The account
comes from ``AZURE_STORAGE_CONNECTION_STRING`` (which may name a ``BlobEndpoint`` and a
``SharedAccessSignature``), else ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY``
(the endpoint ``https://NAME.blob.core.windows.net``). Azure AD credentials (azure-identity's
DefaultAzureCredential: managed identities, ``az login``) are not looked for; a storage made
with ``account_url=`` and ``credential=`` options takes any credential object.
"""

from __future__ import annotations

import http.client
import os
from typing import Any

from .._errors import NoCredentialsError
from . import s3deadline
from .objclient import Failure, ObjectUrl, Words, answer_error, lost_error

DEFAULT_ATTEMPTS = 6  # as S3's: throttling and lost connections retried with a capped backoff
POOL_CONNECTIONS = 64  # above the I/O threads of any transfer: a request never waits for a socket
VARIABLES = "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY"


class MissingAccount(Exception):
    """No account is configured: raised at the first request, which names the URL."""


def make_client(timeout: float, given: dict[str, Any]) -> Any:
    """A ``BlobServiceClient`` whose sockets time out after ``timeout`` seconds, of the variables
    Azure's tools read, or of ``given`` (``connection_string=``, or ``account_url=`` and
    ``credential=``)."""
    import requests
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobServiceClient, ExponentialRetry

    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=POOL_CONNECTIONS, pool_maxsize=POOL_CONNECTIONS)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    s3deadline.watch_session(session)
    options: dict[str, Any] = dict(
        transport=RequestsTransport(session=session, session_owner=True),
        connection_timeout=timeout, read_timeout=timeout,
        retry_policy=ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=DEFAULT_ATTEMPTS - 1),
        max_single_get_size=1 << 20,  # a whole-object GET (a writer record) fetches no more up front
    )
    given = dict(given)
    hook = given.pop("raw_request_hook", None)  # a caller's own, run after the deadline's

    def before_each_attempt(request: Any) -> None:  # (retries included): none starts past its deadline
        s3deadline.refuse_past_deadline()
        if hook is not None:
            hook(request)

    options["raw_request_hook"] = before_each_attempt
    conn = given.pop("connection_string", None) or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if "account_url" in given:
        return BlobServiceClient(**options, **given)
    if conn:
        return BlobServiceClient.from_connection_string(conn, **options, **given)
    name, key = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"), os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    if name and key:
        return BlobServiceClient(f"https://{name}.blob.core.windows.net", credential={"account_name": name,
                                 "account_key": key}, **options, **given)
    raise MissingAccount(f"no Azure account configured: set {VARIABLES}")


_DENIED = {"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
           "InsufficientAccountPermissions", "AccountIsDisabled", "403"}
_THROTTLED = {"ServerBusy", "OperationTimedOut", "IngressOverAccountLimit", "EgressOverAccountLimit",
              "TooManyRequests", "429", "503"}
WORDS = Words("AZURE_STORAGE_CONNECTION_STRING", "the endpoint in AZURE_STORAGE_CONNECTION_STRING", "container", "blob",
              "the account key and its")


def error(e: Exception, url: ObjectUrl | str, what: str) -> Exception:
    """The typed error for a failed request (``what``: the operation, for the message); other
    exceptions are returned as they are. Codes the layer acts on are given as it spells them:
    "412" for a condition not met (the ETag asked for), "InvalidRange" for a range past the end."""
    from azure.core import exceptions as ax

    name = str(url)
    if isinstance(e, MissingAccount):
        return NoCredentialsError(name, f"{e} ({what})")
    if isinstance(e, ax.HttpResponseError) and e.status_code is not None:
        status = e.status_code
        code = getattr(e, "error_code", None)
        code = "412" if status == 412 else str(getattr(code, "value", code) or status)
        failure: Failure = ("bucket" if code == "ContainerNotFound" else "object" if status == 404
                            else "denied" if code in _DENIED or status == 403
                            else "throttled" if code in _THROTTLED or status in (429, 503) else "other")
        return answer_error(url, what, failure, code, str(e.reason or code), WORDS, f"{DEFAULT_ATTEMPTS} attempts")
    import requests
    import urllib3

    if isinstance(e, ax.ServiceRequestError | ax.ServiceResponseError | ax.IncompleteReadError |
                  requests.RequestException | urllib3.exceptions.HTTPError | http.client.HTTPException |
                  ConnectionError | TimeoutError):  # the last ones: a body read in place
        return lost_error(url, what, e, WORDS)
    return e
