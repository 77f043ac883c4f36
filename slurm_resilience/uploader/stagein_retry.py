"""Retries and deadlines of stage-in's and restore's S3 operations.

A transient S3 error (5xx, SlowDown, a timeout, a refused connection) is retried with
backoff for ``checkpoint.stagein_retry_s``, which is also the operation's total deadline,
a hung request included (deadline.py); then the error names S3, the endpoint and what
was being done. Time is read from an injected :class:`Clock`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.clock import Clock as Clock
from slurm_resilience.clock import SystemClock as SystemClock
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.deadline import DeadlineExceeded, run_within
from slurm_resilience.uploader.s3 import TransientS3Error

log = get_logger("checkpoint.stagein")
T = TypeVar("T")
FIRST_ATTEMPT_S = 1.0  # the least a bounded operation's first attempt gets (retry_s may be 0)


class StageinFailed(CheckpointError):
    """A committed step exists (or may exist) but can't be staged in; the message says why."""


@dataclass(frozen=True)
class StageinPolicy:
    """How long stage-in retries S3 and waits for a step still uploading (config keys
    ``stagein_retry_s``, ``stagein_intent_wait_s``, ``stagein_intent_fallback``)."""

    retry_s: float = 120.0
    intent_wait_s: float = 600.0
    intent_fallback: bool = False
    poll_s: float = 2.0
    endpoint: str = ""  # how errors name the S3 endpoint (deadline.endpoint_name)


def retrying(what: str, fn: Callable[[], T], policy: StageinPolicy, clock: Clock, *,
             bounded: bool = True) -> T:
    """``fn`` retried on transient S3 errors for up to ``policy.retry_s``; then StageinFailed.

    A transient error (5xx, SlowDown, a timeout, a refused connection) says nothing
    about the step's content, so it is never taken for corruption. ``bounded``: the
    whole operation, a hung request included, ends by that deadline (the first attempt
    gets at least :data:`FIRST_ATTEMPT_S`); a whole-step download passes False and is
    bounded by each request's timeouts instead.
    """
    deadline = clock.monotonic() + policy.retry_s
    delay = 0.5
    last: TransientS3Error | None = None
    while True:
        limit = max(deadline - clock.monotonic(), 0.0 if last else FIRST_ATTEMPT_S)
        try:
            if limit <= 0 and last is not None:
                raise last
            return run_within(fn, limit, name=f"s3 {what}"[:60]) if bounded else fn()
        except DeadlineExceeded as exc:
            endpoint = policy.endpoint or "(checkpoint.s3_endpoint)"
            window = f"{max(policy.retry_s, FIRST_ATTEMPT_S):g}s (checkpoint.stagein_retry_s"
            if exc.last_error:  # attempts failed, the last one past the deadline
                raise StageinFailed(
                    f"checkpoint: stage-in: couldn't {what}: S3 unreachable or overloaded for "
                    f"{window}) at S3 endpoint {endpoint}: {exc.last_error}") from None
            raise StageinFailed(
                f"checkpoint: stage-in: couldn't {what}: no answer from S3 endpoint "
                f"{endpoint} within {window}; each request waits up to "
                "checkpoint.request_timeout_s)") from None
        except TransientS3Error as exc:
            last = exc
            left = deadline - clock.monotonic()
            if left <= 0:
                raise StageinFailed(
                    f"checkpoint: stage-in: couldn't {what}: S3 unreachable or overloaded for "
                    f"{policy.retry_s:.0f}s (checkpoint.stagein_retry_s): {exc}") from None
            log.warning("stage-in: S3 request failed, retrying", what=what,
                        retry_in_s=round(min(delay, left), 2), error=str(exc))
            clock.sleep(min(delay, left))
            delay = min(delay * 2, 15.0)
