"""Shared filesystems a site lists: each must answer within the timeout and, when asked,
be a mount point (an unmounted path leaves the empty directory behind)."""

from __future__ import annotations

from typing import Any

from slurm_resilience.config.health import MountsCheckSection
from slurm_resilience.health.collectors.mounts import MountsSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok

NAME = "mounts"


def check(snap: MountsSnapshot, cfg: MountsCheckSection, state: dict[str, Any]
          ) -> CheckResult:
    out: list[Finding] = []
    for p in snap.probes:
        if p.timed_out:
            out.append(fail(NAME, p.path, f"{p.path} no answer in {cfg.timeout_s:g}s "
                                          "(expected reachable)"))
        elif not p.reachable:
            out.append(fail(NAME, p.path, f"{p.path} unreachable: {p.error} "
                                          "(expected reachable)"))
        elif cfg.require_mountpoint and not p.mountpoint:
            out.append(fail(NAME, p.path, f"{p.path} not mounted (expected a mount point)"))
        else:
            out.append(ok(NAME, p.path, f"{p.path} reachable ({p.ms or 0:.1f}ms)"))
    return CheckResult(out, state)
