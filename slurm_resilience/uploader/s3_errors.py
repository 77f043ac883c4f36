"""S3 errors: which failures are worth retrying, and the error a caller sees."""

from __future__ import annotations

from slurm_resilience.checkpoint.commit import CheckpointError

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


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def http_status(exc: BaseException) -> str:
    """" (HTTP 403)" for an S3 error answer whose text does not say its status already
    (a refused LIST says only its code, e.g. AccessDenied)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return f" (HTTP {status})" if isinstance(status, int) and str(status) not in str(exc) \
        else ""
