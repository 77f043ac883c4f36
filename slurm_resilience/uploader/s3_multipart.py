"""One file's upload to S3: a single PUT, or a multipart upload resumed from where it was.

The S3 layer knows nothing of the journal. The caller hands in what it kept of an
earlier attempt (``MultipartState``) and gets every change back through ``report``
(``UploadStarted``, ``PartUploaded``, ``PartsDropped``, ``UploadForgotten``), which it
applies to its own record and persists. Parts are sent by the shared pool's threads,
which only return their results: ``report`` is always called on the caller's thread,
as each part finishes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slurm_resilience.checkpoint.crc import crc32c_extend, crc_hex
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.s3_check import ContentChecker
from slurm_resilience.uploader.s3_errors import (
    ContentMismatch,
    PermanentS3Error,
    S3Error,
    error_code,
)

if TYPE_CHECKING:
    from slurm_resilience.uploader.s3 import S3

log = get_logger("checkpoint.s3")
META_CRC = "crc32c"
MiB = 1024**2
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024**3
MAX_PARTS = 10_000
MAX_OBJECT_SIZE = 5 * 1024**4


@dataclass(frozen=True)
class PartResult:
    """A part S3 accepted: its number, ETag, length and the CRC32C of its bytes (hex)."""

    number: int
    etag: str
    size: int
    crc32c: str


@dataclass(frozen=True)
class MultipartState:
    """What the caller kept of an earlier attempt at a file's multipart upload."""

    upload_id: str = ""
    part_size: int = 0
    checksums: bool = False
    parts: Mapping[int, PartResult] = field(default_factory=dict)


@dataclass(frozen=True)
class UploadStarted:
    """A new multipart upload: earlier parts (if any) no longer count."""

    upload_id: str
    part_size: int
    checksums: bool


@dataclass(frozen=True)
class PartUploaded:
    part: PartResult


@dataclass(frozen=True)
class PartsDropped:
    """Parts the caller kept that the server does not have: they are sent again."""

    numbers: tuple[int, ...]


@dataclass(frozen=True)
class UploadForgotten:
    """The multipart upload was aborted (the bytes didn't match): nothing of it is kept."""


UploadEvent = UploadStarted | PartUploaded | PartsDropped | UploadForgotten


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


def b64_crc(value: int) -> str:
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


def upload_file(s3: S3, fd: int, size: int, crc: str, bucket: str, key: str,
                resume: MultipartState, report: Callable[[UploadEvent], None], *,
                blocks: tuple[str, ...], block_size: int, owner: str,
                before_write: Callable[[], None] | None) -> None:
    """See ``S3.upload_fd``."""
    check = ContentChecker(key, size, crc, blocks, block_size)
    part = plan_part_size(size, s3.settings.part_size, s3.settings.max_parts)
    if part != s3.settings.part_size:
        log.info("part size raised to stay within the part limit", key=key, size=size,
                 part_size=part, max_parts=s3.settings.max_parts)
    if size <= part:
        data = os.pread(fd, size, 0) if size else b""
        check.part(0, data)
        check.whole([(crc32c_extend(0, data), len(data))])
        if before_write is not None:
            before_write()
        s3.pool.submit(owner, lambda: s3.put_bytes(bucket, key, data, crc)).result()
        verify_head(s3, bucket, key, size, crc)
        return
    nparts = (size + part - 1) // part
    parts: dict[int, PartResult] = dict(resume.parts)  # this call's own copy
    upload_id = resume.upload_id or None
    if upload_id and (resume.part_size or part) != part:
        log.info("part size changed since the upload started; starting it again", key=key,
                 was=resume.part_size, now=part)
        with contextlib.suppress(S3Error):
            s3.abort(bucket, key, str(upload_id))
        upload_id = None
    if upload_id:
        server = list_parts(s3, bucket, key, upload_id)
        if server is None:  # the upload is gone (aborted, or the endpoint lost it)
            upload_id = None
            parts.clear()
        else:
            gone = []
            for n in sorted(parts):
                if server.get(n) != parts[n].etag or not parts[n].crc32c:
                    log.info("journaled part not on the server; sending it again", key=key,
                             part=n, journal=parts[n].etag, server=server.get(n))
                    del parts[n]
                    gone.append(n)
            if gone:
                report(PartsDropped(tuple(gone)))
    if not upload_id:
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Metadata": {META_CRC: crc}}
        if s3.checksums is not False:
            kw["ChecksumAlgorithm"] = "CRC32C"
        resp = s3.call_checksummed(f"start upload {key}", s3.client.create_multipart_upload,
                                   kw, "ChecksumAlgorithm")
        upload_id = str(resp["UploadId"])
        with_checksums = "ChecksumAlgorithm" in kw
        parts.clear()
        report(UploadStarted(upload_id, part, with_checksums))
    else:
        with_checksums = resume.checksums
    todo = [n for n in range(1, nparts + 1) if n not in parts]
    resumed = nparts - len(todo)
    if resumed:
        log.info("resuming multipart upload", key=key, parts_done=resumed, parts=nparts)

    def send(n: int) -> PartResult:
        offset = (n - 1) * part
        length = min(part, size - offset)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise ContentMismatch(f"checkpoint: s3: upload {key}: file shrank while "
                                  f"uploading (read {len(data)} of {length} bytes at "
                                  f"{offset})")
        part_crc = check.part(offset, data)
        s3.limiter.take(length)
        kw = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": n,
              "Body": data}
        if with_checksums:
            kw["ChecksumCRC32C"] = b64_crc(part_crc)
        resp = s3.call(f"upload part {n} of {key}",
                       functools.partial(s3.client.upload_part, **kw))
        etag = str(resp.get("ETag", ""))
        if not etag:
            raise S3Error(f"checkpoint: s3: upload part {n} of {key}: answer has no ETag")
        if with_checksums:
            s3.note_checksums(resp)
        s3.note_part(owner, key, n)
        return PartResult(n, etag, length, crc_hex(part_crc))

    def keep(result: PartResult) -> None:
        parts[result.number] = result
        report(PartUploaded(result))

    try:
        run_fair(s3, owner, send, todo, keep)
        check.whole([(int(parts[n].crc32c, 16), parts[n].size) for n in sorted(parts)])
    except ContentMismatch:
        with contextlib.suppress(S3Error):
            s3.abort(bucket, key, upload_id)
        report(UploadForgotten())
        raise
    if before_write is not None:
        before_write()
    _complete(s3, bucket, key, upload_id, size, crc, [parts[n] for n in sorted(parts)],
              with_checksums)


def _complete(s3: S3, bucket: str, key: str, upload_id: str, size: int, crc: str,
              parts: list[PartResult], with_checksums: bool) -> None:
    done = []
    for p in parts:
        entry = {"PartNumber": p.number, "ETag": p.etag}
        if with_checksums:
            entry["ChecksumCRC32C"] = b64_crc(int(p.crc32c, 16))
        done.append(entry)
    try:
        resp = s3.call(
            f"complete upload {key}", lambda: s3.client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}))
    except S3Error as exc:
        # Completed before a crash but not journaled: the object is there, the id is not.
        if error_code(exc.__cause__ or exc) == "NoSuchUpload" and \
                s3.head(bucket, key) == (size, crc):
            resp = {"ETag": "(completed earlier)"}
        else:
            raise
    if not resp.get("ETag") or resp.get("Error") or resp.get("Code"):
        raise S3Error(f"checkpoint: s3: complete upload {key}: answer holds no ETag or an "
                      f"error: {resp.get('Error') or resp.get('Code')}")
    if sum(p.size for p in parts) != size or \
            str(resp["ETag"]) != multipart_etag([p.etag for p in parts]):
        # Not the usual MD5-of-part-MD5s ETag (e.g. KMS-encrypted buckets, or completed
        # before a crash): ask for the object's size and CRC32C metadata instead.
        verify_head(s3, bucket, key, size, crc)


def run_fair(s3: S3, owner: str, fn: Callable[[int], PartResult], items: list[int],
             keep: Callable[[PartResult], None]) -> None:
    """Run ``fn`` over ``items`` in the shared pool and hand each result to ``keep`` on
    this thread, as it finishes; the first failure cancels the rest (parts already
    running finish, and what they sent is kept too, so a retry does not send it again)."""
    futures = [s3.pool.submit(owner, functools.partial(fn, i)) for i in items]
    kept: set[Future[PartResult]] = set()
    try:
        for fut in as_completed(futures):
            result = fut.result()
            kept.add(fut)
            keep(result)
    finally:
        for fut in futures:
            fut.cancel()
        for fut in futures:
            if fut in kept or fut.cancelled():
                continue
            try:
                result = fut.result()  # a running part finishes before we return
            except Exception:  # noqa: BLE001, S112 - the first failure is what is raised
                continue
            kept.add(fut)
            keep(result)


def verify_head(s3: S3, bucket: str, key: str, size: int, crc: str) -> None:
    got = s3.head(bucket, key)
    if got is None or got[0] != size or (got[1] and got[1] != crc):
        raise S3Error(f"checkpoint: s3: verify {key}: S3 has (size, crc32c) {got}, "
                      f"expected ({size}, {crc})")


def list_parts(s3: S3, bucket: str, key: str, upload_id: str) -> dict[int, str] | None:
    out: dict[int, str] = {}
    marker = 0
    while True:
        try:
            resp = s3.call(f"list parts of {key}", functools.partial(
                s3.client.list_parts, Bucket=bucket, Key=key, UploadId=upload_id,
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
