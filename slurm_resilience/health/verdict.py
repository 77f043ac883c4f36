"""Combine findings into one decision under each check's fail-open/fail-closed policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from slurm_resilience.health.findings import Finding, Severity


@dataclass(frozen=True)
class Verdict:
    """``blocking`` are the findings that take the node out of service."""

    healthy: bool
    blocking: list[Finding]
    findings: list[Finding]

    def reason(self) -> str:
        """A short drain reason: the first blocking finding, then a count of the rest."""
        if not self.blocking:
            return ""
        rest = len(self.blocking) - 1
        return self.blocking[0].reason + (f" (+{rest} more)" if rest else "")


def decide(findings: list[Finding], policies: Mapping[str, str]) -> Verdict:
    """FAIL always blocks; UNKNOWN blocks only where that check is fail-closed."""
    blocking = [
        f for f in findings
        if f.severity is Severity.FAIL
        or (f.severity is Severity.UNKNOWN
            and policies.get(f.check, "fail-closed") == "fail-closed")
    ]
    return Verdict(healthy=not blocking, blocking=blocking, findings=findings)
