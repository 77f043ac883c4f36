"""What a check reports: a severity, the thing concerned, and actual against expected."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Severity(enum.IntEnum):
    """Ordered so the worst finding wins: ok < warn < unknown < fail.

    ``unknown`` means "could not check"; the verdict's per-check policy decides
    whether it takes the node out (fail-closed) or is only reported (fail-open).
    """

    OK = 0
    WARN = 1
    UNKNOWN = 2
    FAIL = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    """One observation. ``message`` is short enough to be a drain reason:
    ``gpu3 XID 79 (GPU fell off the bus) 12:01:07``."""

    check: str
    subject: str
    severity: Severity
    message: str
    data: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "subject": self.subject, "severity": self.severity.label,
                "message": self.message, "data": self.data}


@dataclass(frozen=True)
class CheckResult:
    """A check's findings plus the state to keep for its next run (counter baselines,
    Xid events already seen, streaks)."""

    findings: list[Finding]
    state: dict[str, Any] = field(default_factory=dict)


def ok(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.OK, message, data)


def warn(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.WARN, message, data)


def fail(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.FAIL, message, data)


def unknown(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.UNKNOWN, message, data)


def human_size(n: int) -> str:
    """``53687091200`` → ``50.0GiB``, for messages."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"
