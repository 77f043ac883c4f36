"""A total deadline for one S3 operation of stage-in or restore.

boto3's connect and read timeouts bound each socket wait, not an operation: an endpoint
that accepts connections and never answers costs a read timeout per attempt, and our
retries multiply that. Here the operation runs in a worker thread and the caller waits
at most its limit; past it the caller gets :class:`DeadlineExceeded` at once. The worker
keeps the deadline in a context variable, so :meth:`S3.call` starts no new attempt after
it (the hung request ends at its own read timeout, then the worker stops).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

class _Budget:
    """The deadline of the operation running in this context, and its last failure (set
    by the worker, read by the caller that gave up on it)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.last_error = ""


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "s3_operation_budget", default=None)


class DeadlineExceeded(Exception):
    """The operation had no result when its limit ran out (it may still be running);
    ``last_error``: the failure its latest attempt reported, "" when none did (no answer)."""

    def __init__(self, limit_s: float, last_error: str = ""):
        super().__init__(f"no result within {limit_s:g}s"
                         + (f"; last error: {last_error}" if last_error else ": no answer"))
        self.limit_s = limit_s
        self.last_error = last_error


def seconds_left() -> float | None:
    """Seconds left before the current operation's deadline; None when it has none."""
    budget = _BUDGET.get()
    return None if budget is None else budget.deadline - time.monotonic()


def note_failure(error: str) -> None:
    """Record an attempt's failure for the caller, should it give up on the operation."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.last_error = error


def run_within(fn: Callable[[], T], limit_s: float, name: str = "s3-op") -> T:
    """``fn()``'s result or exception, or :class:`DeadlineExceeded` once ``limit_s``
    seconds passed without either."""
    value: list[T] = []
    error: list[BaseException] = []
    done = threading.Event()
    ctx = contextvars.copy_context()
    budget = _Budget(time.monotonic() + limit_s)

    def bounded() -> T:
        _BUDGET.set(budget)
        return fn()

    def work() -> None:
        try:
            value.append(ctx.run(bounded))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=work, name=name, daemon=True).start()
    if not done.wait(limit_s):
        raise DeadlineExceeded(limit_s, budget.last_error)
    if error:
        raise error[0]
    return value[0]


def endpoint_name(endpoint: str, region: str = "") -> str:
    """How an error names the S3 endpoint: its URL, or AWS's default for the region."""
    return endpoint or f"AWS S3 ({region or 'default region'})"
