"""Shared filesystems a site lists: each must answer within the timeout and, when asked,
be a mount point (an unmounted path leaves the empty directory behind)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_resilience.config.health import MountsCheckSection
from slurm_resilience.config.paths import node_path
from slurm_resilience.health.checks.spec import CheckSpec, Collect, Judged, NoState, RunFacts
from slurm_resilience.health.collectors.mounts import MountsSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok

if TYPE_CHECKING:
    from slurm_resilience.config import Config

NAME = "mounts"


def check(snap: MountsSnapshot, cfg: MountsCheckSection, state: NoState
          ) -> CheckResult[NoState]:
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


def _collect(cfg: Config, node: str, active: bool) -> Collect:
    import functools

    from slurm_resilience.health.collectors import mounts

    h = cfg.health
    return functools.partial(mounts.collect_json, [node_path(p, node) for p in h.mounts.paths],
                             h.mounts.timeout_s)


def _judge(snap: MountsSnapshot, state: NoState, facts: RunFacts) -> Judged[NoState]:
    return check(snap, facts.cfg.health.mounts, state), []


SPEC = CheckSpec(NAME, lambda h: h.mounts, MountsSnapshot.from_json, _judge, NoState, rank=8,
                 collect=_collect, applies=lambda h, kind: bool(h.mounts.paths))
