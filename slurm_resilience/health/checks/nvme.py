"""Checks of the local NVMe / checkpoint staging disk."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_resilience.config.health import NvmeCheckSection
from slurm_resilience.config.paths import node_path
from slurm_resilience.health.checks.spec import CheckSpec, Collect, Judged, NoState, RunFacts
from slurm_resilience.health.collectors.nvme import NvmeSnapshot, SmartLog
from slurm_resilience.health.findings import (
    CheckResult,
    Finding,
    fail,
    human_size,
    ok,
    unknown,
    warn,
)

if TYPE_CHECKING:
    from slurm_resilience.config import Config

NAME = "nvme"


def check(snap: NvmeSnapshot, cfg: NvmeCheckSection, state: NoState) -> CheckResult[NoState]:
    path = snap.path or cfg.path
    if snap.error:
        return CheckResult([unknown(NAME, "nvme", f"nvme: {snap.error}")], state)
    if not snap.exists:
        return CheckResult([fail(NAME, "nvme", f"nvme {path} missing (expected a directory)")],
                           state)
    out: list[Finding] = []
    if cfg.require_mountpoint and not snap.mountpoint:
        out.append(fail(NAME, "nvme", f"nvme {path} not mounted (expected a mount point)"))
    if snap.read_only:
        out.append(fail(NAME, "nvme", f"nvme {path} read-only (expected writable)"))
    free, total = snap.free, snap.total
    # Committed checkpoint steps the agent evicts under pressure are our own retention,
    # not a shortage: they count as free (a stale or forged record counts as nothing).
    usable = None if free is None else free + snap.reclaimable
    if usable is not None and usable < cfg.min_free:
        extra = (f" (+{human_size(snap.reclaimable)} reclaimable by checkpoint eviction)"
                 if snap.reclaimable else "")
        out.append(fail(NAME, "nvme", f"nvme {human_size(free or 0)} free{extra} of "
                                      f"{human_size(total or 0)} "
                                      f"(expected >={human_size(cfg.min_free)})",
                        free=free, total=total, reclaimable=snap.reclaimable))
    if snap.reclaim_note:
        out.append(warn(NAME, "nvme", f"nvme {snap.reclaim_note}"))
    if snap.probe_error:
        out.append(fail(NAME, "nvme", f"nvme {snap.probe_error}"))
    probe = snap.probe_ms
    if probe is not None and probe > cfg.max_probe_ms:
        out.append(warn(NAME, "nvme", f"nvme write+fsync {probe:.0f}ms "
                                      f"(expected <={cfg.max_probe_ms:.0f}ms)"))
    smart = snap.smart or SmartLog()
    if smart.error:
        out.append(unknown(NAME, "nvme-smart", f"nvme {smart.error}"))
    if smart.critical_warning:
        out.append(fail(NAME, "nvme-smart", f"nvme critical warning "
                                            f"0x{smart.critical_warning:02x} (expected 0)"))
    used = smart.percentage_used
    if used is not None and used > cfg.max_percentage_used:
        out.append(fail(NAME, "nvme-smart", f"nvme {used}% endurance used "
                                            f"(expected <={cfg.max_percentage_used}%)"))
    media = smart.media_errors
    if media is not None and cfg.max_media_errors >= 0 and media > cfg.max_media_errors:
        out.append(fail(NAME, "nvme-smart", f"nvme {media} media errors "
                                            f"(expected <={cfg.max_media_errors})"))
    spare, spare_min = smart.available_spare, smart.available_spare_threshold
    floor = max(cfg.min_available_spare, spare_min or 0)
    if spare is not None and floor and spare < floor:
        out.append(fail(NAME, "nvme-smart", f"nvme {spare}% available spare "
                                            f"(expected >={floor}%)"))
    if not out:
        out.append(ok(NAME, "nvme", f"nvme {path} {human_size(free or 0)} free"
                                    + (f" (+{human_size(snap.reclaimable)} reclaimable by "
                                       "checkpoint eviction)" if snap.reclaimable else "")
                                    + (f", probe {probe:.1f}ms" if probe is not None else "")))
    return CheckResult(out, state)


def _collect(cfg: Config, node: str, active: bool) -> Collect:
    import functools

    from slurm_resilience.health.collectors import nvme

    h = cfg.health
    return functools.partial(
        nvme.collect_json, node_path(h.nvme.path, node), size_limit=h.nvme.size_limit,
        active=active and h.nvme.probe, smart=active and h.nvme.smart, device=h.nvme.device,
        timeout=h.collector_timeout_s,
        reclaim_dir=node_path(cfg.node.state_dir, node) if cfg.checkpoint.enabled else "",
        reclaim_below=int(h.nvme.min_free))


def _judge(snap: NvmeSnapshot, state: NoState, facts: RunFacts) -> Judged[NoState]:
    return check(snap, facts.cfg.health.nvme, state), []


SPEC = CheckSpec(NAME, lambda h: h.nvme, NvmeSnapshot.from_json, _judge, NoState, rank=7,
                 collect=_collect, applies=lambda h, kind: bool(h.nvme.path))
