"""S3 transfers for the agent: multipart, concurrent, resumable, retried with backoff.

Part bodies are protected in transit by the SigV4 payload hash (plain HTTP
endpoints: botocore signs the body's SHA-256, which S3 checks) or by TLS; the
journal record of a file (upload id, parts with their ETag and CRC32C) is updated
after each part, so a killed agent resumes without re-sending completed parts.
CompleteMultipartUpload can answer 200 with an error in its body: botocore turns
that into an error for this operation, and we also require an ETag in the parsed
answer and check the object's size and CRC32C metadata with HEAD afterwards.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from slurm_resilience.checkpoint.commit import CheckpointError, Crc32c
from slurm_resilience.log import get_logger

log = get_logger("checkpoint.s3")
T = TypeVar("T")
META_CRC = "crc32c"


class S3Error(CheckpointError):
    """An S3 operation failed for good (after retries, or not retryable)."""


class TransientS3Error(S3Error):
    """The endpoint is unreachable or overloaded; try again later."""


@dataclass(frozen=True)
class S3Settings:
    endpoint: str = ""
    region: str = "us-east-1"
    credentials_file: str = ""
    part_size: int = 64 * 1024**2
    concurrency: int = 8
    rate_limit: int = 0
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    request_timeout_s: float = 30.0
    attempts: int = 4


def read_credentials(path: str) -> tuple[str, str]:
    """``ACCESS_KEY_ID SECRET`` from a root-only file."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise CheckpointError(f"checkpoint: config: s3_credentials_file {path} must not be "
                              f"readable by group/others (mode {oct(st.st_mode & 0o777)})")
    with open(path, encoding="utf-8") as fh:
        fields = fh.read().split()
    if len(fields) != 2:
        raise CheckpointError(f"checkpoint: config: s3_credentials_file {path} must hold "
                              "'ACCESS_KEY_ID SECRET_ACCESS_KEY'")
    return fields[0], fields[1]


class _RateLimiter:
    """A token bucket shared by all upload threads; 0 means unlimited."""

    def __init__(self, rate: int):
        self.rate = rate
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + nbytes / self.rate
        time.sleep(max(0.0, start - now))


def _is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    if isinstance(exc, (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError,
                        ReadTimeoutError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError",
                                         "ServiceUnavailable", "RequestTimeTooSkewed")
    return type(exc).__name__ in ("ProtocolError", "IncompleteReadError", "ResponseStreamingError")


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives an object assembled from parts with these (MD5) ETags.

    Matching it proves the server stitched together exactly the parts we sent, whose
    bytes it checked on arrival, without reading the whole object back.
    """
    try:
        digests = b"".join(bytes.fromhex(e.strip('"')) for e in part_etags)
    except ValueError:
        return ""
    return f'"{hashlib.md5(digests).hexdigest()}-{len(part_etags)}"'  # noqa: S324


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


class S3:
    """A boto3 client with our retries, transfers and checks."""

    def __init__(self, settings: S3Settings):
        import boto3
        from botocore.config import Config as BotoConfig

        self.settings = settings
        kwargs: dict[str, Any] = {"region_name": settings.region}
        if settings.endpoint:
            kwargs["endpoint_url"] = settings.endpoint
        if settings.credentials_file:
            key, secret = read_credentials(settings.credentials_file)
            kwargs["aws_access_key_id"] = key
            kwargs["aws_secret_access_key"] = secret
        cfg = BotoConfig(
            max_pool_connections=max(10, settings.concurrency * 2),
            connect_timeout=settings.request_timeout_s,
            read_timeout=settings.request_timeout_s,
            retries={"max_attempts": 1, "mode": "standard"},  # our own backoff governs
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"},
        )
        self.client = boto3.session.Session().client("s3", config=cfg, **kwargs)
        self.limiter = _RateLimiter(settings.rate_limit)
        self.parts_sent = 0  # multipart parts actually transferred (logs and tests)
        self.objects_put = 0  # single-request uploads
        self._count_lock = threading.Lock()

    # -- retries ----------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with exponential backoff and jitter on transient failures."""
        s = self.settings
        delay = s.retry_initial_s
        for attempt in range(1, s.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if not _is_transient(exc):
                    raise S3Error(f"checkpoint: s3: couldn't {what}: {exc}") from exc
                if attempt == s.attempts:
                    raise TransientS3Error(f"checkpoint: s3: couldn't {what} after {attempt} "
                                           f"attempts: {exc}") from exc
                sleep = min(delay, s.retry_max_s) * random.uniform(0.5, 1.0)  # noqa: S311
                log.warning("s3 request failed, retrying", what=what, attempt=attempt,
                            backoff_s=round(sleep, 2), error=str(exc))
                time.sleep(sleep)
                delay *= 2
        raise AssertionError("unreachable")

    # -- small objects ----------------------------------------------------------------------

    def put_bytes(self, bucket: str, key: str, body: bytes, crc: str) -> None:
        md5 = hashlib.md5(body)  # noqa: S324 - S3's integrity check, not security
        resp = self.call(f"put {key}", lambda: self.client.put_object(
            Bucket=bucket, Key=key, Body=body, ContentMD5=base64.b64encode(md5.digest()).decode(),
            Metadata={META_CRC: crc}))
        if not resp.get("ETag"):
            raise S3Error(f"checkpoint: s3: put {key}: answer has no ETag")
        with self._count_lock:
            self.objects_put += 1

    def get_bytes(self, bucket: str, key: str, limit: int = 64 * 1024**2) -> bytes:
        resp = self.call(f"get {key}", lambda: self.client.get_object(Bucket=bucket, Key=key))
        if int(resp.get("ContentLength", 0)) > limit:
            raise S3Error(f"checkpoint: s3: {key} is larger than {limit} bytes")
        data: bytes = resp["Body"].read()
        return data

    def head(self, bucket: str, key: str) -> tuple[int, str] | None:
        """(size, crc32c metadata) of an object, or None if it does not exist."""
        try:
            resp = self.call(f"head {key}", lambda: self.client.head_object(Bucket=bucket,
                                                                             Key=key))
        except S3Error as exc:
            if error_code(exc.__cause__ or exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        meta = {k.lower(): v for k, v in (resp.get("Metadata") or {}).items()}
        return int(resp["ContentLength"]), str(meta.get(META_CRC, ""))

    def list_keys(self, bucket: str, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` with its size."""
        out: dict[str, int] = {}
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            resp = self.call(f"list {prefix}", functools.partial(self.client.list_objects_v2, **kw))
            for obj in resp.get("Contents", []) or []:
                out[str(obj["Key"])] = int(obj["Size"])
            if not resp.get("IsTruncated"):
                return out
            token = resp.get("NextContinuationToken")

    def delete_keys(self, bucket: str, keys: list[str]) -> None:
        for key in keys:
            self.call(f"delete {key}", functools.partial(
                self.client.delete_object, Bucket=bucket, Key=key))

    # -- multipart upload ---------------------------------------------------------------------

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.parts_sent += n

    def upload_fd(self, fd: int, size: int, crc: str, bucket: str, key: str,
                  record: dict[str, Any], save: Callable[[], None]) -> None:
        """Upload an open file; ``record`` (journal) holds the upload id and finished parts,
        and ``save()`` persists it after each change."""
        part = self.settings.part_size
        if size <= part:
            self.put_bytes(bucket, key, os.pread(fd, size, 0) if size else b"", crc)
            self._verify_head(bucket, key, size, crc)
            return
        nparts = (size + part - 1) // part
        parts: dict[str, dict[str, Any]] = record.setdefault("parts", {})
        upload_id = record.get("upload_id")
        if upload_id:
            server = self._list_parts(bucket, key, upload_id)
            if server is None:  # the upload is gone (aborted, or the endpoint lost it)
                upload_id = None
                parts.clear()
            else:
                for n in list(parts):
                    if server.get(int(n)) != parts[n]["etag"]:
                        log.info("journaled part not on the server; sending it again", key=key,
                                 part=n, journal=parts[n]["etag"], server=server.get(int(n)))
                        del parts[n]
        if not upload_id:
            resp = self.call(f"start upload {key}", lambda: self.client.create_multipart_upload(
                Bucket=bucket, Key=key, Metadata={META_CRC: crc}))
            upload_id = str(resp["UploadId"])
            record["upload_id"] = upload_id
            parts.clear()
            save()
        lock = threading.Lock()
        todo = [n for n in range(1, nparts + 1) if str(n) not in parts]
        resumed = nparts - len(todo)
        if resumed:
            log.info("resuming multipart upload", key=key, parts_done=resumed, parts=nparts)

        def send(n: int) -> None:
            offset = (n - 1) * part
            length = min(part, size - offset)
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise S3Error(f"checkpoint: s3: {key}: file shrank while uploading")
            part_crc = Crc32c()
            part_crc.update(data)
            self.limiter.take(length)
            resp = self.call(f"upload part {n} of {key}", lambda: self.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data))
            etag = str(resp.get("ETag", ""))
            if not etag:
                raise S3Error(f"checkpoint: s3: upload part {n} of {key}: answer has no ETag")
            self._count(1)
            with lock:
                parts[str(n)] = {"etag": etag, "size": length, "crc32c": part_crc.hexdigest()}
                save()

        self._run_parallel(send, todo)
        done = [{"PartNumber": int(n), "ETag": parts[n]["etag"]}
                for n in sorted(parts, key=int)]
        try:
            resp = self.call(
                f"complete upload {key}", lambda: self.client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}))
        except S3Error as exc:
            # Completed before a crash but not journaled: the object is there, the id is not.
            if error_code(exc.__cause__ or exc) == "NoSuchUpload" and \
                    self.head(bucket, key) == (size, crc):
                resp = {"ETag": "(completed earlier)"}
            else:
                raise
        if not resp.get("ETag") or resp.get("Error") or resp.get("Code"):
            raise S3Error(f"checkpoint: s3: complete upload {key}: answer holds no ETag or an "
                          f"error: {resp.get('Error') or resp.get('Code')}")
        if sum(int(parts[n]["size"]) for n in parts) != size or \
                str(resp["ETag"]) != multipart_etag([parts[n]["etag"] for n in
                                                     sorted(parts, key=int)]):
            # Not the usual MD5-of-part-MD5s ETag (e.g. KMS-encrypted buckets, or completed
            # before a crash): ask for the object's size and CRC32C metadata instead.
            self._verify_head(bucket, key, size, crc)
        record.pop("upload_id", None)
        parts.clear()

    def _verify_head(self, bucket: str, key: str, size: int, crc: str) -> None:
        got = self.head(bucket, key)
        if got is None or got[0] != size or (got[1] and got[1] != crc):
            raise S3Error(f"checkpoint: s3: verify {key}: S3 has (size, crc32c) {got}, "
                          f"expected ({size}, {crc})")

    def _list_parts(self, bucket: str, key: str, upload_id: str) -> dict[int, str] | None:
        out: dict[int, str] = {}
        marker = 0
        while True:
            try:
                resp = self.call(f"list parts of {key}", functools.partial(
                    self.client.list_parts, Bucket=bucket, Key=key, UploadId=upload_id,
                    PartNumberMarker=marker))
            except S3Error as exc:
                if error_code(exc.__cause__ or exc) in ("NoSuchUpload", "404"):
                    return None
                raise
            for p in resp.get("Parts", []) or []:
                out[int(p["PartNumber"])] = str(p["ETag"])
            if not resp.get("IsTruncated"):
                return out
            marker = int(resp.get("NextPartNumberMarker", 0))

    def _run_parallel(self, fn: Callable[[int], None], items: list[int]) -> None:
        if not items:
            return
        with ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(items))) as pool:
            for fut in [pool.submit(fn, i) for i in items]:
                fut.result()

    def multipart_uploads(self, bucket: str, prefix: str
                          ) -> Iterator[tuple[str, str, float | None]]:
        """(key, upload id, age in seconds) of every unfinished multipart upload."""
        try:
            resp = self.call(f"list uploads {prefix}", lambda: self.client.list_multipart_uploads(
                Bucket=bucket, Prefix=prefix))
        except S3Error as exc:
            # Some S3 servers (rclone's) answer NoSuchUpload when there is none.
            if error_code(exc.__cause__ or exc) == "NoSuchUpload":
                return
            raise
        now = time.time()
        for u in resp.get("Uploads", []) or []:
            started = u.get("Initiated")
            age = now - started.timestamp() if hasattr(started, "timestamp") else None
            yield str(u["Key"]), str(u["UploadId"]), age

    def abort(self, bucket: str, key: str, upload_id: str) -> None:
        self.call(f"abort upload {key}", lambda: self.client.abort_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id))

    # -- download ---------------------------------------------------------------------------

    def download_fd(self, bucket: str, key: str, size: int, fd: int) -> str:
        """Download into ``fd`` with parallel ranged GETs; returns the CRC32C of the file."""
        part = self.settings.part_size

        def fetch(n: int) -> None:
            start = n * part
            end = min(size, start + part) - 1
            resp = self.call(f"get {key} bytes {start}-{end}", lambda: self.client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{end}"))
            data = resp["Body"].read()
            if len(data) != end - start + 1:
                raise S3Error(f"checkpoint: s3: get {key}: short read at {start}")
            view = memoryview(data)
            pos = start
            while view:
                written = os.pwrite(fd, view, pos)
                view = view[written:]
                pos += written

        os.ftruncate(fd, size)
        self._run_parallel(fetch, list(range((size + part - 1) // part)) if size else [])
        crc = Crc32c()
        offset = 0
        while offset < size:
            chunk = os.pread(fd, 8 * 1024 * 1024, offset)
            if not chunk:
                break
            crc.update(chunk)
            offset += len(chunk)
        return crc.hexdigest()
