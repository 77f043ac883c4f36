"""S3 transfers for the agent: multipart, concurrent, resumable, retried with backoff.

* Part size: the configured size, raised (in whole MiB) when a file would need more
  than S3's 10,000 parts, so objects up to 5 TiB upload (``plan_part_size``).
* Errors: transient ones (5xx, throttling, timeouts, connection errors) are retried
  with jittered, bounded backoff and then raise ``TransientS3Error`` (the caller
  tries again later); anything else (AccessDenied, NoSuchBucket, InvalidArgument,
  ...) raises ``PermanentS3Error`` at once, never retried.
* Content: the CRC32C of the bytes actually read and sent is computed per part and
  compared with the manifest (each whole block inside the part, and the whole file,
  rebuilt from the parts' CRCs); a mismatch aborts the upload (``ContentMismatch``)
  and nothing is marked uploaded. The CRC32C also goes to S3 (``x-amz-checksum-crc32c``)
  so S3 checks the bytes it receives; endpoints that ignore it (``rclone serve s3``
  accepts and drops it) are detected, logged once, and not sent it again.
* Part bodies are also protected in transit by the SigV4 payload hash (plain HTTP
  endpoints: botocore signs the body's SHA-256, which S3 checks) or by TLS. The
  journal record of a file (upload id, part size, parts with their ETag and CRC32C)
  is updated after each part, so a killed agent resumes without re-sending parts.
  CompleteMultipartUpload can answer 200 with an error in its body: botocore turns
  that into an error for this operation, and we also require an ETag in the parsed
  answer and check the object's size and CRC32C metadata with HEAD afterwards.
* Uploads of all jobs share one ``FairPool``: parts are taken from the jobs in turn.
* ``put_if_absent`` writes with ``If-None-Match: *`` where the endpoint honours it
  (probed once per bucket), else checks with HEAD first and says so in the log.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.crc import crc32c_extend, crc_hex
from slurm_resilience.checkpoint.crc_combine import combine_parts
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.deadline import endpoint_name, note_failure, seconds_left
from slurm_resilience.uploader.fairpool import FairPool
from slurm_resilience.uploader.journal import FileDoc, PartDoc

log = get_logger("checkpoint.s3")
T = TypeVar("T")
META_CRC = "crc32c"
MiB = 1024**2
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024**3
MAX_PARTS = 10_000
MAX_OBJECT_SIZE = 5 * 1024**4
_CRC_HEX = re.compile(r"[0-9a-f]{8}")

# Answers that mean "try again": overload, throttling, in-flight corruption, clock skew.
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests",
    "RequestLimitExceeded", "RequestThrottled", "RequestTimeout", "InternalError",
    "ServiceUnavailable", "RequestTimeTooSkewed", "BadDigest", "XAmzContentSHA256Mismatch",
    "XAmzContentChecksumMismatch",
    "ConditionalRequestConflict", "OperationAborted", "IncompleteBody"})


class S3Error(CheckpointError):
    """An S3 operation failed (after retries, or not retryable)."""


class TransientS3Error(S3Error):
    """The endpoint is unreachable or overloaded; try again later."""


class PermanentS3Error(S3Error):
    """S3 refused the request (4xx: AccessDenied, NoSuchBucket, InvalidArgument, ...):
    sending it again will not help."""


class ContentMismatch(CheckpointError):
    """The bytes read from the file do not match its manifest; the upload was aborted."""


def plan_part_size(size: int, part_size: int, max_parts: int = MAX_PARTS) -> int:
    """The part size for a file: ``part_size``, or the smallest whole MiB that keeps it
    within ``max_parts`` parts. Raises PermanentS3Error past S3's object size limit."""
    if size > MAX_OBJECT_SIZE:
        raise PermanentS3Error(f"checkpoint: s3: couldn't plan upload: {size} bytes is more "
                               f"than S3's object limit of {MAX_OBJECT_SIZE} bytes (5 TiB)")
    if size <= part_size * max_parts:
        return part_size
    need = -(-size // max_parts)
    planned = -(-need // MiB) * MiB
    if planned > MAX_PART_SIZE:
        raise PermanentS3Error(f"checkpoint: s3: couldn't plan upload: {size} bytes need parts "
                               f"of {planned} bytes, more than S3's 5 GiB part limit")
    return planned


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
    max_parts: int = MAX_PARTS  # S3's limit; tests lower it to reach the boundary


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


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: connection, timeout, 5xx, 408/429, throttling."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        HTTPClientError,
        ReadTimeoutError,
    )

    if isinstance(exc, (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError,
                        ReadTimeoutError, HTTPClientError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or status in (408, 429) or code in TRANSIENT_CODES
    return type(exc).__name__ in ("ProtocolError", "IncompleteReadError", "ResponseStreamingError")


def _b64_crc(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


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


def _http_status(exc: BaseException) -> str:
    """" (HTTP 403)" for an S3 error answer whose text does not say its status already
    (a refused LIST says only its code, e.g. AccessDenied)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return f" (HTTP {status})" if isinstance(status, int) and str(status) not in str(exc) \
        else ""


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
        # (owner, key, part) of the latest parts, in the order they finished (logs, tests)
        self.sent_log: deque[tuple[str, str, int]] = deque(maxlen=10_000)
        self._count_lock = threading.Lock()
        self._pool: FairPool | None = None
        self.checksums: bool | None = None  # does the endpoint check x-amz-checksum-crc32c?
        self._conditional: dict[str, bool] = {}  # bucket -> honours If-None-Match

    @property
    def pool(self) -> FairPool:
        with self._count_lock:
            if self._pool is None:
                self._pool = FairPool(self.settings.concurrency, "s3-upload")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    # -- retries ----------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with exponential backoff and jitter on transient failures."""
        s = self.settings
        delay = s.retry_initial_s
        for attempt in range(1, s.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise PermanentS3Error(f"checkpoint: s3: couldn't {what}: {exc}"
                                           f"{_http_status(exc)}") from exc
                note_failure(str(exc))
                sleep = min(delay, s.retry_max_s) * random.uniform(0.5, 1.0)  # noqa: S311
                left = seconds_left()  # an operation's total deadline (deadline.py)
                if attempt == s.attempts or (left is not None and left <= sleep):
                    raise TransientS3Error(
                        f"checkpoint: s3: couldn't {what} at S3 endpoint "
                        f"{endpoint_name(s.endpoint, s.region)} after {attempt} attempts: "
                        f"{exc}") from exc
                log.warning("s3 request failed, retrying", what=what, attempt=attempt,
                            backoff_s=round(sleep, 2), error=str(exc))
                time.sleep(sleep)
                delay *= 2
        raise AssertionError("unreachable")

    # -- small objects ----------------------------------------------------------------------

    def put_bytes(self, bucket: str, key: str, body: bytes, crc: str, *,
                  if_none_match: bool = False) -> None:
        md5 = hashlib.md5(body)  # noqa: S324 - S3's integrity check, not security
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": body,
                              "ContentMD5": base64.b64encode(md5.digest()).decode(),
                              "Metadata": {META_CRC: crc}}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        if self.checksums is not False:
            kw["ChecksumCRC32C"] = _b64_crc(int(crc, 16))
        resp = self._call_checksummed(f"put {key}", self.client.put_object, kw,
                                      "ChecksumCRC32C")
        if not resp.get("ETag"):
            raise S3Error(f"checkpoint: s3: put {key}: answer has no ETag")
        if "ChecksumCRC32C" in kw:
            self._note_checksums(resp)
        with self._count_lock:
            self.objects_put += 1

    def _call_checksummed(self, what: str, fn: Callable[..., dict[str, Any]],
                          kw: dict[str, Any], field: str) -> dict[str, Any]:
        """Call ``fn(**kw)``; an endpoint that refuses the checksum ``field`` (while we
        don't know yet whether it takes checksums) gets the request again without it."""
        try:
            return self.call(what, functools.partial(fn, **kw))
        except PermanentS3Error as exc:
            code = error_code(exc.__cause__ or exc)
            if field not in kw or self.checksums is not None or code not in (
                    "NotImplemented", "InvalidArgument", "InvalidRequest", "BadRequest",
                    "400", "501"):
                raise
            self.checksums = False
            log.warning("s3 endpoint refuses CRC32C checksum headers; sending without them "
                        "(our own comparison with the manifest still applies)",
                        endpoint=self.settings.endpoint or "aws", code=code)
            kw.pop(field)
            return self.call(what, functools.partial(fn, **kw))

    def _note_checksums(self, resp: dict[str, Any]) -> None:
        """Learn from the first answer whether the endpoint checks our CRC32C; log it once."""
        if self.checksums is not None:
            return
        self.checksums = bool(resp.get("ChecksumCRC32C"))
        if self.checksums:
            log.info("s3 endpoint checks CRC32C checksums of what we send",
                     endpoint=self.settings.endpoint or "aws")
        else:
            log.warning("s3 endpoint ignores CRC32C checksums; only our own comparison with "
                        "the manifest and the SigV4 payload hash protect the bytes",
                        endpoint=self.settings.endpoint or "aws")

    def conditional_writes(self, bucket: str, prefix: str) -> bool:
        """Whether the endpoint honours ``If-None-Match: *`` (probed once per bucket)."""
        if bucket in self._conditional:
            return self._conditional[bucket]
        probe = f"{prefix}.sr-probe-{os.urandom(6).hex()}"
        supported = False  # unless the second write is refused
        try:
            self.put_bytes(bucket, probe, b"", "00000000", if_none_match=True)
            self.put_bytes(bucket, probe, b"", "00000000", if_none_match=True)
        except PermanentS3Error as exc:
            code = error_code(exc.__cause__ or exc)
            supported = code in ("PreconditionFailed", "412")
            if not supported and code not in ("NotImplemented", "501", "InvalidArgument",
                                              "InvalidRequest", "400"):
                raise
        finally:
            with contextlib.suppress(S3Error):
                self.delete_keys(bucket, [probe])
        self._conditional[bucket] = supported
        if supported:
            log.info("commit markers are written with If-None-Match", bucket=bucket,
                     mode="conditional")
        else:  # a race between two jobs' last writers is not excluded: say so
            log.warning("s3 endpoint ignores If-None-Match; commit markers are written "
                        "check-then-put", bucket=bucket, mode="check-then-put")
        return supported

    def put_if_absent(self, bucket: str, key: str, body: bytes, crc: str,
                      prefix: str = "") -> bool:
        """Write ``key`` only if it does not exist; False when it already did."""
        if self.conditional_writes(bucket, prefix):
            try:
                self.put_bytes(bucket, key, body, crc, if_none_match=True)
            except PermanentS3Error as exc:
                if error_code(exc.__cause__ or exc) in ("PreconditionFailed", "412"):
                    return False
                raise
            return True
        if self.head(bucket, key) is not None:
            return False
        self.put_bytes(bucket, key, body, crc)
        return True

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
        return {k: size for k, (size, _) in self.list_objects(bucket, prefix).items()}

    def list_objects(self, bucket: str, prefix: str) -> dict[str, tuple[int, float]]:
        """Every key under ``prefix`` with its size and last-modified time (epoch s)."""
        out: dict[str, tuple[int, float]] = {}
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            resp = self.call(f"list {prefix}", functools.partial(self.client.list_objects_v2, **kw))
            for obj in resp.get("Contents", []) or []:
                mtime = obj.get("LastModified")
                out[str(obj["Key"])] = (int(obj["Size"]), mtime.timestamp()
                                        if hasattr(mtime, "timestamp") else 0.0)
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
                  record: FileDoc, save: Callable[[], None], *,
                  blocks: tuple[str, ...] = (), block_size: int = BLOCK_SIZE,
                  owner: str = "", lock: threading.RLock | None = None,
                  before_write: Callable[[], None] | None = None) -> None:
        """Upload an open file whose manifest says ``size``, ``crc`` (and per-block CRCs).

        ``record`` (journal) holds the upload id, part size and finished parts, and
        ``save()`` persists it after each change. Parts go through the shared fair pool
        under ``owner``; ``lock`` (the journal owner's) guards changes to ``record``.
        Raises ContentMismatch (upload aborted) when the bytes read don't match the
        manifest. ``before_write()`` runs just before the object is written (the PUT, or
        the completion of the multipart upload) and may raise to stop it; the multipart
        upload then stays open, in ``record``, for the caller to abort.
        """
        check = _Checker(key, size, crc, blocks, block_size)
        part = plan_part_size(size, self.settings.part_size, self.settings.max_parts)
        if part != self.settings.part_size:
            log.info("part size raised to stay within the part limit", key=key, size=size,
                     part_size=part, max_parts=self.settings.max_parts)
        if size <= part:
            data = os.pread(fd, size, 0) if size else b""
            check.part(0, data)
            check.whole([(crc32c_extend(0, data), len(data))])
            if before_write is not None:
                before_write()
            self.pool.submit(owner, lambda: self.put_bytes(bucket, key, data, crc)).result()
            self._verify_head(bucket, key, size, crc)
            return
        nparts = (size + part - 1) // part
        parts: dict[str, PartDoc] = record.setdefault("parts", {})
        upload_id = record.get("upload_id")
        if upload_id and int(record.get("part_size", part)) != part:
            log.info("part size changed since the upload started; starting it again", key=key,
                     was=record.get("part_size"), now=part)
            with contextlib.suppress(S3Error):
                self.abort(bucket, key, str(upload_id))
            upload_id = None
        if upload_id:
            server = self._list_parts(bucket, key, upload_id)
            if server is None:  # the upload is gone (aborted, or the endpoint lost it)
                upload_id = None
                parts.clear()
            else:
                for n in list(parts):
                    if server.get(int(n)) != parts[n].get("etag") or "crc32c" not in parts[n]:
                        log.info("journaled part not on the server; sending it again", key=key,
                                 part=n, journal=parts[n].get("etag"), server=server.get(int(n)))
                        del parts[n]
        if not upload_id:
            kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Metadata": {META_CRC: crc}}
            if self.checksums is not False:
                kw["ChecksumAlgorithm"] = "CRC32C"
            resp = self._call_checksummed(f"start upload {key}",
                                          self.client.create_multipart_upload, kw,
                                          "ChecksumAlgorithm")
            upload_id = str(resp["UploadId"])
            record["upload_id"] = upload_id
            record["part_size"] = part
            record["checksums"] = "ChecksumAlgorithm" in kw
            parts.clear()
            save()
        with_checksums = bool(record.get("checksums"))
        lock = lock or threading.RLock()
        todo = [n for n in range(1, nparts + 1) if str(n) not in parts]
        resumed = nparts - len(todo)
        if resumed:
            log.info("resuming multipart upload", key=key, parts_done=resumed, parts=nparts)

        def send(n: int) -> None:
            offset = (n - 1) * part
            length = min(part, size - offset)
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise ContentMismatch(f"checkpoint: s3: upload {key}: file shrank while "
                                      f"uploading (read {len(data)} of {length} bytes at "
                                      f"{offset})")
            part_crc = check.part(offset, data)
            self.limiter.take(length)
            kw = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": n,
                  "Body": data}
            if with_checksums:
                kw["ChecksumCRC32C"] = _b64_crc(part_crc)
            resp = self.call(f"upload part {n} of {key}",
                             functools.partial(self.client.upload_part, **kw))
            etag = str(resp.get("ETag", ""))
            if not etag:
                raise S3Error(f"checkpoint: s3: upload part {n} of {key}: answer has no ETag")
            if with_checksums:
                self._note_checksums(resp)
            self._count(1)
            with lock:
                self.sent_log.append((owner, key, n))
                parts[str(n)] = {"etag": etag, "size": length, "crc32c": crc_hex(part_crc)}
                save()

        try:
            self._run_fair(owner, send, todo)
            check.whole([(int(parts[n]["crc32c"], 16), int(parts[n]["size"]))
                         for n in sorted(parts, key=int)])
        except ContentMismatch:
            with contextlib.suppress(S3Error):
                self.abort(bucket, key, upload_id)
            record.pop("upload_id", None)
            parts.clear()
            save()
            raise
        if before_write is not None:
            before_write()
        done = []
        for n in sorted(parts, key=int):
            entry = {"PartNumber": int(n), "ETag": parts[n]["etag"]}
            if with_checksums:
                entry["ChecksumCRC32C"] = _b64_crc(int(parts[n]["crc32c"], 16))
            done.append(entry)
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

    def _run_fair(self, owner: str, fn: Callable[[int], None], items: list[int]) -> None:
        """Run ``fn`` over ``items`` in the shared pool; the first failure cancels the rest."""
        futures = [self.pool.submit(owner, functools.partial(fn, i)) for i in items]
        try:
            for fut in futures:
                fut.result()
        finally:
            for fut in futures:
                fut.cancel()
            for fut in futures:
                if not fut.cancelled():
                    with contextlib.suppress(Exception):
                        fut.result()  # let running parts finish before the journal is saved

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

    def download_fd(self, bucket: str, key: str, size: int, fd: int,
                    progress: Callable[[int], None] | None = None) -> str:
        """Download into ``fd`` with parallel ranged GETs; returns the CRC32C of the bytes
        received (each range's CRC32C, combined: no second pass over the file).

        Each range streams to the file in ``_STREAM_CHUNK`` pieces as it arrives (no
        whole part in memory), and a range that fails mid-body is fetched again.
        """
        part = self.settings.part_size
        crcs: dict[int, tuple[int, int]] = {}

        def get_range(start: int, end: int) -> int:
            resp = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
            body = resp["Body"]
            crc, pos = 0, start
            try:
                while pos <= end:
                    chunk = body.read(min(_STREAM_CHUNK, end + 1 - pos))
                    if not chunk:
                        break
                    crc = crc32c_extend(crc, chunk)
                    view = memoryview(chunk)
                    while view:
                        written = os.pwrite(fd, view, pos)
                        view = view[written:]
                        pos += written
            finally:
                body.close()
            if pos != end + 1:
                raise ConnectionError(f"short read at {pos} of bytes {start}-{end}")
            return crc

        def fetch(n: int) -> None:
            start = n * part
            end = min(size, start + part) - 1
            crc = self.call(f"get {key} bytes {start}-{end}",
                            functools.partial(get_range, start, end))
            crcs[n] = (crc, end - start + 1)
            if progress is not None:  # a whole range, once (a retried one is not counted twice)
                progress(end - start + 1)

        os.ftruncate(fd, size)
        self._run_parallel(fetch, list(range((size + part - 1) // part)) if size else [])
        return crc_hex(combine_parts([crcs[n] for n in sorted(crcs)]))


_STREAM_CHUNK = 4 * MiB


class _Checker:
    """Compares the bytes read for an upload with the file's manifest.

    A block wholly inside a part is checked as the part is read; a block that spans
    parts is checked once all its pieces were read (their CRCs combined), so with
    blocks listed, every byte is compared before the upload completes.
    """

    def __init__(self, key: str, size: int, crc: str, blocks: tuple[str, ...], block_size: int):
        self.key, self.size, self.crc = key, size, crc
        self.blocks, self.block_size = blocks, block_size
        if not _CRC_HEX.fullmatch(crc):  # it also goes into S3 metadata: plain hex only
            raise ContentMismatch(f"checkpoint: s3: upload {key}: manifest crc32c {crc!r} is "
                                  "not 8 hex digits; refusing the file")
        self._pieces: dict[int, dict[int, tuple[int, int]]] = {}  # block -> offset -> (crc, n)
        self._lock = threading.Lock()

    def part(self, offset: int, data: bytes) -> int:
        """The CRC32C of a part (read at ``offset``) after checking the blocks it covers."""
        if self.blocks:
            view = memoryview(data)
            end = offset + len(data)
            pos = offset
            while pos < end:
                i = pos // self.block_size
                bstart = i * self.block_size
                bend = min(bstart + self.block_size, self.size)
                cut = min(bend, end)
                piece = crc32c_extend(0, view[pos - offset:cut - offset])
                if pos == bstart and cut == bend:
                    self._compare(i, piece)
                else:
                    self._add_piece(i, pos - bstart, piece, cut - pos, bend - bstart)
                pos = cut
        return crc32c_extend(0, data)

    def _add_piece(self, index: int, at: int, crc: int, length: int, block_len: int) -> None:
        with self._lock:
            pieces = self._pieces.setdefault(index, {})
            pieces[at] = (crc, length)
            if sum(n for _, n in pieces.values()) < block_len:
                return
            del self._pieces[index]
        self._compare(index, combine_parts([pieces[k] for k in sorted(pieces)]))

    def _compare(self, index: int, crc: int) -> None:
        if index >= len(self.blocks) or crc_hex(crc) != self.blocks[index]:
            start = index * self.block_size
            raise ContentMismatch(
                f"checkpoint: s3: upload {self.key}: block {index} (from byte {start}) has "
                f"crc32c {crc_hex(crc)}, the manifest says "
                f"{self.blocks[index] if index < len(self.blocks) else 'no such block'}; "
                "refusing it")

    def whole(self, parts: list[tuple[int, int]]) -> None:
        """The CRC32C of the whole file, rebuilt from its parts, must be the manifest's."""
        got = crc_hex(combine_parts(parts))
        total = sum(length for _, length in parts)
        if total != self.size or got != self.crc:
            raise ContentMismatch(
                f"checkpoint: s3: upload {self.key}: the bytes read have size {total} crc32c "
                f"{got}, the manifest says size {self.size} crc32c {self.crc}; refusing them")
