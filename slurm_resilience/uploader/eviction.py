"""Which committed staging steps the agent evicts under space pressure: a pure decision.

A step is evictable when losing its local copy loses nothing a job still needs:

* a running job's newest committed step is never evicted (its restart point);
* a step already in S3 goes at once (a restart stages it back in);
* a local-only step of a finished job goes ``grace_s`` after the job ended (a requeue
  that starts within the grace still finds it), at once if the job is over its quota;
* a running job's older local-only steps stay (``keep_local`` retention handles them);
* a step of a job with a run URI that S3 does not hold yet stays: it is on its way there,
  and the uploader's journal still expects it.

Order: steps already in S3 first, then local-only ones, each oldest commit first, and
only as many as bring free space back to the target. ``reclaimable`` is what eviction
will free without any job's help (grace ignored), so the health gate's free-space
check does not drain a node for space our own retention holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagedStep:
    """One committed step in a job's staging dir, as the agent measured it."""

    job_id: int
    step: int
    nbytes: int
    committed_at: float  # wall clock of the step's COMMIT.json
    in_s3: bool
    job_ended_at: float | None  # None: the job still runs
    over_quota: bool = False  # the job's dir is past its quota: no grace for its steps
    uploading: bool = False  # the job has a run URI and S3 does not hold the step yet


def protected(s: StagedStep, steps: list[StagedStep]) -> bool:
    """A step still to be uploaded, a running job's newest step, or one of its
    local-only steps."""
    if s.uploading:
        return True
    if s.job_ended_at is not None:
        return False
    newest = max(o.step for o in steps if o.job_id == s.job_id)
    return s.step == newest or not s.in_s3


def evictable(steps: list[StagedStep], now: float, grace_s: float) -> list[StagedStep]:
    """Steps eviction may take at ``now``, in eviction order."""
    out = []
    for s in steps:
        if protected(s, steps):
            continue
        if (not s.in_s3 and s.job_ended_at is not None and not s.over_quota
                and now - s.job_ended_at < grace_s):
            continue
        out.append(s)
    return sorted(out, key=lambda s: (not s.in_s3, s.committed_at, s.job_id, s.step))


def reclaimable(steps: list[StagedStep]) -> int:
    """Bytes eviction frees without any job's help, counting local-only steps whose
    grace still runs (they go when it ends)."""
    return sum(s.nbytes for s in steps if not protected(s, steps))


def plan_eviction(steps: list[StagedStep], free: int, target_free: int, now: float,
                  grace_s: float) -> list[StagedStep]:
    """Steps to evict, in order, until ``free`` reaches ``target_free``; none without
    pressure. When evicting everything allowed is not enough, all of it goes."""
    need = target_free - free
    out: list[StagedStep] = []
    for s in evictable(steps, now, grace_s):
        if need <= 0:
            break
        out.append(s)
        need -= s.nbytes
    return out
