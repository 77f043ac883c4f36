"""The per-job share of the staging disk: a pure decision over measured usage.

There are no filesystem project quotas to rely on (XFS/ext4 project quotas are not
set up on every cluster), so the agent measures each job's staging dir on every pass
and holds it to ``checkpoint.job_quota_fraction`` of the staging disk. A job over its
quota is never given more: its local-only steps lose their grace (evicted under
pressure at once, newest step of a running job excepted) and every ``ckpt.status``
answer says so; :func:`check_save` is the same decision before a save writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.checkpoint.errors import CheckpointError

SETTING = "checkpoint.job_quota_fraction"


@dataclass(frozen=True)
class Quota:
    """A job's share of the staging disk, in bytes, and where it came from."""

    limit: int
    fraction: float
    disk_total: int


def job_quota(disk_total: int, fraction: float) -> Quota:
    return Quota(int(disk_total * fraction), fraction, disk_total)


def over_quota(used: int, quota: Quota) -> bool:
    return used > quota.limit


def describe(job_id: int, used: int, quota: Quota, incoming: int = 0) -> str:
    more = f"; this save adds {incoming:,} bytes" if incoming else ""
    return (f"checkpoint: staging quota: job {job_id} uses {used:,} bytes of its "
            f"{quota.limit:,}-byte quota ({SETTING}={quota.fraction:g} of a "
            f"{quota.disk_total:,}-byte staging disk){more}")


def check_save(job_id: int, used: int, incoming: int, quota: Quota) -> None:
    """Refuse a save that would take the job past its quota, before it writes."""
    if used + incoming > quota.limit:
        raise CheckpointError(describe(job_id, used, quota, incoming)
                              + "; free older steps or raise the setting")
