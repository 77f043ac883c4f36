"""S3 URIs of runs and the per-user prefix policy (``s3://bucket/{user}/``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_resilience.checkpoint.commit import CheckpointError

# Matched whole (fullmatch): "$" alone would let a trailing newline through.
_SEGMENT = re.compile(r"[A-Za-z0-9._=+@,-]+")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class PrefixDenied(CheckpointError):
    """A run URI outside the prefix its user may write to."""


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str  # without leading or trailing '/'

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"

    def join(self, *parts: str) -> str:
        """The object key of ``parts`` under this URI."""
        return "/".join(p for p in (self.key, *parts) if p)


def parse_uri(text: str, *, what: str = "URI") -> S3Uri:
    """``s3://bucket/a/b`` with plain segments only: no '..', '.', empty or odd characters."""
    if not text.startswith("s3://"):
        raise CheckpointError(f"checkpoint: {what} {text!r} must start with s3://")
    if not text.isprintable():
        raise CheckpointError(f"checkpoint: {what} {text!r} has control characters")
    rest = text[len("s3://"):].rstrip("/")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise CheckpointError(f"checkpoint: {what} {text!r}: {bucket!r} is not a bucket name")
    segments = key.split("/") if key else []
    for seg in segments:
        if seg in (".", "..") or not _SEGMENT.fullmatch(seg):
            raise CheckpointError(f"checkpoint: {what} {text!r}: path segment {seg!r} is not "
                                  "allowed (letters, digits and ._=+@,- only; no '.'/'..')")
    return S3Uri(bucket, key)


def allowed_prefix(template: str, user: str) -> S3Uri:
    """The prefix ``user`` may write under, from a template such as ``s3://ckpt/{user}/``."""
    if not user or not _SEGMENT.fullmatch(user) or user in (".", ".."):
        raise CheckpointError(f"checkpoint: user name {user!r} cannot be used in a prefix")
    return parse_uri(template.replace("{user}", user), what="allowed_prefix")


def check_run_uri(uri: str, template: str, user: str) -> S3Uri:
    """The run URI if it lies strictly below the user's allowed prefix; else PrefixDenied."""
    if not template:
        raise PrefixDenied("checkpoint: S3 staging is not configured on this cluster "
                           "(checkpoint.allowed_prefix is empty); unset SLURM_RESILIENCE_CKPT_URI")
    run = parse_uri(uri, what="SLURM_RESILIENCE_CKPT_URI")
    allowed = allowed_prefix(template, user)
    inside = run.bucket == allowed.bucket and (
        not allowed.key or run.key.startswith(allowed.key + "/"))
    if not inside or run.key == allowed.key:
        raise PrefixDenied(f"checkpoint: URI {uri} is outside the prefix user {user} may write "
                           f"to: {allowed}/ (use e.g. {allowed}/my-run)")
    return run
