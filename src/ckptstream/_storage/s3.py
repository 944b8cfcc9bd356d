"""S3-compatible object stores as a storage: ``s3://bucket/key`` URLs, the S3 adapter of the
object-store layer (``objstore``, ``objsource``, ``objupload`` over ``objclient``'s protocol).

Each ``S3Storage`` makes its own boto3 clients (``s3client``), one per ``s3_timeout`` in force,
from the standard AWS configuration and its own options: two storages reach two endpoints.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

from . import s3client
from .objclient import Answer, Head, MiB, ObjectUrl, Page, Upload, ViewBody, body_reader, crc_b64, total_of
from .objsource import FIRST, ObjectSource
from .objstore import STALE_AFTER, ObjectStorage

__all__ = ["FIRST", "STALE_AFTER", "S3Client", "S3Source", "S3Storage", "reset_clients"]
S3Source = ObjectSource

MIN_PART = 5 * MiB  # S3's smallest part but the last
MAX_PART = 5 << 30
MAX_PARTS = 10_000


def crc32c_b64(data: memoryview | bytes) -> str:
    """A CRC-32C of ``data`` as S3's x-amz-checksum-crc32c header spells it."""
    from .. import _checksum

    return crc_b64(_checksum.crc_of(data))


class S3Client:
    """``objclient.ObjectClient`` over one boto3 client."""

    name = "S3"
    min_part, max_part, max_parts = MIN_PART, MAX_PART, MAX_PARTS
    page = 1000  # keys per ListObjectsV2 page and uploads per ListMultipartUploads page (S3's most)
    delete_batch = 1000  # keys per DeleteObjects request (S3's limit)
    words = s3client.WORDS

    def __init__(self, boto: Any) -> None:
        self.boto, self.endpoint = boto, str(boto.meta.endpoint_url)
        self.attempts = s3client.DEFAULT_ATTEMPTS
        self.error = s3client.error

    def head(self, url: ObjectUrl) -> Head:
        head = self.boto.head_object(Bucket=url.bucket, Key=url.key)
        return Head(int(head["ContentLength"]), head.get("ETag") or None)

    def check_bucket(self, url: ObjectUrl) -> None:
        self.boto.head_bucket(Bucket=url.bucket)

    def get(self, url: ObjectUrl, lo: int, hi: int, etag: str | None) -> Answer:
        kwargs: dict[str, Any] = {"Bucket": url.bucket, "Key": url.key, "Range": f"bytes={lo}-{hi - 1}"}
        if etag is not None:
            kwargs["IfMatch"] = etag
        response = self.boto.get_object(**kwargs)
        readinto, done = _reader(response["Body"])
        return Answer(int(response["ContentLength"]), total_of(response.get("ContentRange")),
                      response.get("ETag") or None, readinto, done)

    def get_whole(self, url: ObjectUrl) -> tuple[int, Callable[[], bytes], Callable[[], None]]:
        response = self.boto.get_object(Bucket=url.bucket, Key=url.key)
        body = response["Body"]
        return int(response["ContentLength"]), body.read, body.close

    def put(self, url: ObjectUrl, data: memoryview, crc: int) -> None:
        self.boto.put_object(Bucket=url.bucket, Key=url.key, Body=ViewBody(data), ContentLength=len(data),
                             ChecksumCRC32C=crc_b64(crc))

    def list_page(self, url: ObjectUrl, prefix: str, *, delimiter: bool, limit: int, token: Any) -> Page:
        page = self.boto.list_objects_v2(Bucket=url.bucket, Prefix=prefix, MaxKeys=limit,
                                         **({"Delimiter": "/"} if delimiter else {}),
                                         **({"ContinuationToken": token} if token else {}))
        following = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return Page([o["Key"] for o in page.get("Contents", ())], [p["Prefix"] for p in page.get("CommonPrefixes", ())],
                    following or None)

    def delete(self, url: ObjectUrl) -> None:
        self.boto.delete_object(Bucket=url.bucket, Key=url.key)

    def delete_many(self, url: ObjectUrl, keys: Sequence[str]) -> list[tuple[str, str, str]]:
        answer = self.boto.delete_objects(Bucket=url.bucket, Delete={"Objects": [{"Key": k} for k in keys],
                                                                      "Quiet": True})
        return [(e.get("Key", ""), str(e.get("Code")), str(e.get("Message"))) for e in answer.get("Errors") or ()]

    def create_upload(self, url: ObjectUrl) -> str:
        upload_id: str = self.boto.create_multipart_upload(Bucket=url.bucket, Key=url.key,
                                                           ChecksumAlgorithm="CRC32C")["UploadId"]
        return upload_id

    def upload_part(self, url: ObjectUrl, upload_id: str, number: int, data: memoryview, crc: int) -> str:
        etag: str = self.boto.upload_part(Bucket=url.bucket, Key=url.key, UploadId=upload_id, PartNumber=number,
                                          Body=ViewBody(data), ContentLength=len(data),
                                          ChecksumCRC32C=crc_b64(crc))["ETag"]
        return etag

    def complete_upload(self, url: ObjectUrl, upload_id: str, parts: list[tuple[int, str, int]]) -> None:
        listed = [{"PartNumber": n, "ETag": etag, "ChecksumCRC32C": crc_b64(crc)} for n, etag, crc in parts]
        self.boto.complete_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                            MultipartUpload={"Parts": listed})

    def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        self.boto.abort_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id)

    def list_uploads(self, url: ObjectUrl, prefix: str, *, limit: int, token: Any) -> tuple[list[Upload], Any]:
        try:
            page = self.boto.list_multipart_uploads(Bucket=url.bucket, Prefix=prefix, MaxUploads=limit, **(token or {}))
        except Exception as e:
            if getattr(e, "response", {}).get("Error", {}).get("Code") == "NoSuchUpload":
                return [], None  # some servers answer so for a bucket that never had an upload
            raise
        uploads = [Upload(u["Key"], u["UploadId"], u["Initiated"]) for u in page.get("Uploads", ())]
        following = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        return uploads, following if page.get("IsTruncated") else None

    def touched(self, url: ObjectUrl, upload: Upload) -> datetime.datetime:
        parts = self.boto.list_parts(Bucket=url.bucket, Key=url.key, UploadId=upload.upload_id).get("Parts", ())
        last: datetime.datetime = max([upload.started, *(p["LastModified"] for p in parts)])
        return last


class S3Storage(ObjectStorage):
    """``scheme://bucket/key`` URLs (``s3`` unless told) on the endpoint the standard AWS
    configuration names, or the one ``options`` (``boto3.client``'s keyword arguments:
    ``endpoint_url``, ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``) give."""

    def __init__(self, scheme: str = "s3", **options: Any) -> None:
        import boto3  # noqa: F401  (made at the first s3:// URL: without boto3, that URL says what to install)

        super().__init__(scheme, options)

    def make_client(self, timeout: float) -> S3Client:
        """A client of its own boto3 session (botocore clients are thread-safe; sessions are not)."""
        return S3Client(s3client.make_client(timeout, self._options))


def reset_clients() -> None:
    """Every S3 storage's ``reset_client`` (the AWS configuration changed)."""
    S3Storage.reset_all()


def _reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[bool], None]]:
    """How to read a GET's body (botocore's, over urllib3's response) straight into a buffer,
    and how to let it go: in place where the layers under botocore are the ones known, else
    through botocore's own readinto (``objclient.body_reader``)."""
    return body_reader(getattr(body, "_raw_stream", None), body.close, body.readinto)
