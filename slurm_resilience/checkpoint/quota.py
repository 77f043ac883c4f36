"""The per-job share of the staging disk: a pure decision over measured usage.

There are no filesystem project quotas to rely on (XFS/ext4 project quotas are not
set up on every cluster), so the agent measures each job's staging dir on every pass
and holds it to ``checkpoint.job_quota_fraction`` of the staging disk. A job over its
quota is never given more: its local-only steps lose their grace (evicted under
pressure at once, newest step of a running job excepted) and every ``ckpt.status``
answer says so; :func:`check_save` is the same decision before a save writes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


def state_bytes(state: Mapping[Any, Any]) -> int:
    """The bytes a save of ``state`` writes on this rank: its tensors' local shards."""
    total = 0
    stack: list[Any] = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        else:
            local = getattr(value, "_local_tensor", value)  # a DTensor writes its shard
            nbytes = getattr(local, "nbytes", None)
            if isinstance(nbytes, int):
                total += nbytes
    return total


def check_before_save(job_dir: str, job_id: int, state: Mapping[Any, Any],
                      fraction: float) -> None:
    """The training side of the quota: refuse a save that would take the job's staging dir
    past its share of the disk, before anything is written (the agent holds every job to
    the same share at its passes, which also catches bytes a job writes by itself)."""
    from slurm_resilience.checkpoint.reclaim_record import tree_bytes_at

    vfs = os.statvfs(job_dir)
    parent, base = os.path.split(os.path.abspath(job_dir))
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        used = tree_bytes_at(pfd, base, apparent=False)
    finally:
        os.close(pfd)
    check_save(job_id, used, state_bytes(state), job_quota(vfs.f_blocks * vfs.f_frsize,
                                                            fraction))
