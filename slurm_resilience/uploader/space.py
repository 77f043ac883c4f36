"""The agent's staging-disk pass: measure every job's dir, hold jobs to their quota,
evict committed steps under space pressure, and record what eviction can reclaim.

Gather (walk each job dir through fds, bounded), decide (``eviction.plan_eviction``,
``quota.over_quota``: pure), act (remove the chosen steps, write the record the health
gate's nvme check reads). A job that writes files itself into its staging dir is
counted like any other bytes there: at the next pass it is over its quota, its
local-only steps lose their grace, and its staging dir is named in the agent's log and
in ``ckpt.status``. Bytes outside committed steps (scratch files, partial saves) are
never counted as reclaimable, so they can still make the gate drain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from slurm_resilience.checkpoint import quota as quotas
from slurm_resilience.checkpoint import reclaim_record
from slurm_resilience.checkpoint.commit import COMMIT, step_name
from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.checkpoint.reclaim_record import tree_bytes_at
from slurm_resilience.checkpoint.staging import open_job_dir, remove_at
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config.paths import node_path
from slurm_resilience.config.schema import Config
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalBudget, RemovalIncomplete
from slurm_resilience.uploader.eviction import StagedStep, plan_eviction, protected
from slurm_resilience.uploader.journal import JobRecord
from slurm_resilience.uploader.rootfs import committed_steps_at

log = get_logger("checkpoint.space")

IN_S3 = ("committed", "pruned")


@dataclass(frozen=True)
class DiskSpace:
    total: int
    free: int


def disk_space(root: str, size_limit: int) -> DiskSpace:
    """The staging disk's size and free bytes, as the health gate's nvme collector sees
    them (``size_limit``: the sandbox's stand-in disk of that size)."""
    vfs = os.statvfs(root)
    total, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    if size_limit:
        parent, base = os.path.split(os.path.abspath(root))
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            used = tree_bytes_at(pfd, base, apparent=True)
        finally:
            os.close(pfd)
        total, free = size_limit, min(free, max(0, size_limit - used))
    return DiskSpace(total, free)


@dataclass(frozen=True)
class JobUsage:
    job_id: int
    used: int
    steps: list[StagedStep]


def measure_job(rec: JobRecord, jfd: int, *, apparent: bool, over_limit: int) -> JobUsage:
    """A job dir's bytes and its committed steps (``over_limit``: the job's quota)."""
    job_id = int(rec["job_id"])
    parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=jfd)
    try:
        used = tree_bytes_at(parent, f"job-{job_id}", apparent=apparent)
    finally:
        os.close(parent)
    over = used > over_limit
    ended = rec.get("ended_at") if rec.get("state") != "active" else None
    uploaded = {s for s, d in rec["steps"].items() if d.get("state") in IN_S3}
    steps = []
    for step in committed_steps_at(jfd):
        sname = step_name(step)
        try:
            at = os.stat(f"{sname}/{COMMIT}", dir_fd=jfd, follow_symlinks=False).st_mtime
            nbytes = tree_bytes_at(jfd, sname, apparent=apparent)
        except FileNotFoundError:
            continue
        in_s3 = str(step) in uploaded
        steps.append(StagedStep(job_id, step, nbytes, at, bool(rec.get("uri")) and in_s3,
                                float(ended) if ended is not None else None, over,
                                uploading=bool(rec.get("uri")) and not in_s3))
    return JobUsage(job_id, used, steps)


@dataclass
class SpaceKeeper:
    """One pass over the staging disk at a time (the uploader calls :meth:`run`)."""

    cfg: Config
    node: str
    clock: Clock = field(default_factory=SystemClock)  # its wall time ages the steps
    over_quota: dict[int, str] = field(default_factory=dict)  # job → the message

    def __post_init__(self) -> None:
        ck, nv = self.cfg.checkpoint, self.cfg.health.nvme
        self.root = node_path(ck.staging_root, self.node)
        self.state_dir = node_path(self.cfg.node.state_dir, self.node)
        self.size_limit = int(nv.size_limit)
        # No staging disk in the health gate: nothing drains for space, and no record.
        self.gated = bool(nv.path)
        self.target = int(ck.eviction_free_target) or (int(nv.min_free) if self.gated else 0)

    def run(self, jobs: list[JobRecord], busy: set[int]) -> list[StagedStep]:
        """Measure, decide, evict; the evicted steps. ``busy``: jobs whose upload runs
        now (their steps are measured but not evicted this pass)."""
        ck = self.cfg.checkpoint
        if not os.path.isdir(self.root):
            return []  # no job has staged here yet: nothing to measure or reclaim
        apparent = bool(self.size_limit)  # the sandbox's stand-in counts apparent sizes
        space = disk_space(self.root, self.size_limit)
        limit = quotas.job_quota(space.total, ck.job_quota_fraction)
        usages: list[JobUsage] = []
        for rec in jobs:
            try:
                with open_job_dir(rec["staging_root"], int(rec["job_id"])) as jfd:
                    usages.append(measure_job(rec, jfd, apparent=apparent,
                                              over_limit=limit.limit))
            except FileNotFoundError:
                continue
            except (CheckpointError, OSError) as exc:
                log.warning("checkpoint: space: couldn't measure a job's staging dir",
                            job_id=rec["job_id"], error=str(exc))
        self._note_quota(usages, limit)
        steps = [s for u in usages for s in u.steps]
        now = self.clock.time()
        plan = [s for s in plan_eviction(steps, space.free, self.target, now,
                                         ck.eviction_grace_s) if s.job_id not in busy]
        evicted = self._evict(plan, {int(r["job_id"]): r for r in jobs})
        gone = {(s.job_id, s.step) for s in evicted}
        left = [s for s in steps if (s.job_id, s.step) not in gone]
        if not self.gated:
            return evicted
        try:
            reclaim_record.write(self.state_dir, self.root, [
                (f"job-{s.job_id}", step_name(s.step)) for s in left
                if not protected(s, left)], now)
        except OSError as exc:
            log.error("checkpoint: space: couldn't write the reclaimable record; the health "
                      "gate judges the disk by its real free space", error=str(exc))
        return evicted

    def _note_quota(self, usages: list[JobUsage], limit: quotas.Quota) -> None:
        now_over = {}
        for u in usages:
            if quotas.over_quota(u.used, limit):
                now_over[u.job_id] = quotas.describe(u.job_id, u.used, limit)
                if u.job_id not in self.over_quota:
                    log.error("checkpoint: staging dir over its quota; its local-only steps "
                              "lose their grace", job_id=u.job_id, used=u.used,
                              quota=limit.limit, setting=quotas.SETTING)
        self.over_quota = now_over

    def _evict(self, plan: list[StagedStep], recs: dict[int, JobRecord]) -> list[StagedStep]:
        out = []
        budget = RemovalBudget(max_entries=self.cfg.checkpoint.remove_max_entries,
                               max_seconds=self.cfg.checkpoint.remove_max_s)
        for s in plan:
            rec = recs.get(s.job_id)
            if rec is None:
                continue
            try:
                with open_job_dir(rec["staging_root"], s.job_id) as jfd:
                    remove_at(jfd, step_name(s.step), budget)
            except RemovalIncomplete as exc:
                log.warning("evicted step only partly removed; the rest goes next pass",
                            job_id=s.job_id, step=s.step, error=str(exc))
                break
            except (CheckpointError, OSError) as exc:
                log.error("checkpoint: space: couldn't evict a step", job_id=s.job_id,
                          step=s.step, error=str(exc))
                continue
            log.warning("evicted committed step for space", job_id=s.job_id, step=s.step,
                        bytes=s.nbytes, in_s3=s.in_s3, job_ended=s.job_ended_at is not None)
            out.append(s)
        return out
