"""The commands the uploader's record owner runs for its workers (owner.py has the model).

The owner thread alone holds the journal records (``Uploader.jobs``) and their
bookkeeping (``syncing``, ``stageins``, ``backoff``, ``orphans_checked``, ``stale_due``,
``space_due``). A worker (a job's sync, a stage-in, retention, the space pass) does its
I/O on a private working copy the owner handed out, and reports what it found as one of
these commands: the owner applies it to the record and writes the journal. Anything the
owner hands out is a deep copy, the caller's to keep.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from slurm_resilience.log import get_logger
from slurm_resilience.uploader.journal import (
    JobRecord,
    JobState,
    StageinDoc,
    StepDoc,
    StepState,
)
from slurm_resilience.uploader.owner import Command

if TYPE_CHECKING:
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.uploader")


@dataclass(frozen=True)
class UploaderSnapshot:
    """What other services (metrics) read of the uploader: copies of its journal records,
    made by the owner thread, theirs to keep."""

    jobs: Mapping[int, JobRecord]


def _mine(up: Uploader, job_id: int, what: str) -> JobRecord | None:
    """The owner's record of a job (None when the job is gone: a worker's late report)."""
    up.owner.check(what)
    rec = up.jobs.get(job_id)
    if rec is None:
        log.info("a report about a job the uploader no longer tracks; dropped",
                 job_id=job_id, report=what)
    return rec


@dataclass(frozen=True)
class Snapshot(Command["Uploader", UploaderSnapshot]):
    def apply(self, up: Uploader) -> UploaderSnapshot:
        return UploaderSnapshot(MappingProxyType(copy.deepcopy(up.jobs)))


@dataclass(frozen=True)
class RecordCopy(Command["Uploader", "JobRecord | None"]):
    """A working copy of one job's record (None when the uploader doesn't track it)."""

    job_id: int

    def apply(self, up: Uploader) -> JobRecord | None:
        rec = up.jobs.get(self.job_id)
        return copy.deepcopy(rec) if rec is not None else None


@dataclass(frozen=True)
class StepReport(Command["Uploader", None]):
    """A worker's new state of one step (its frozen copy): the record takes it."""

    job_id: int
    step: int
    doc: StepDoc

    def apply(self, up: Uploader) -> None:
        rec = _mine(up, self.job_id, f"step {self.step} report")
        if rec is not None:
            rec["steps"][str(self.step)] = copy.deepcopy(self.doc)
            up.write(rec)


@dataclass(frozen=True)
class NoteSteps(Command["Uploader", "JobRecord | None"]):
    """Steps committed in the staging dir count as pending from now on; answers a fresh
    working copy of the record."""

    job_id: int
    steps: tuple[int, ...]

    def apply(self, up: Uploader) -> JobRecord | None:
        rec = _mine(up, self.job_id, "local steps")
        if rec is None:
            return None
        new = [s for s in self.steps if str(s) not in rec["steps"]]
        for step in new:
            rec["steps"][str(step)] = {"state": StepState.PENDING, "files": {},
                                       "since": time.time()}
        if new:
            up.write(rec)
        return copy.deepcopy(rec)


@dataclass(frozen=True)
class StageinFinished(Command["Uploader", None]):
    """A stage-in's result; a step it took from S3 is never uploaded again."""

    job_id: int
    result: StageinDoc
    started: float

    def apply(self, up: Uploader) -> None:
        rec = _mine(up, self.job_id, "stage-in result")
        if rec is None:
            return
        res = self.result
        if res.get("source") == "s3" and res.get("step") is not None:
            rec["steps"][str(res["step"])] = {"state": StepState.COMMITTED, "staged_in": True}
        # When it ran, for the metrics (stage-in time) and goodput.
        rec["stagein"] = {**res, "started": self.started, "finished": time.time()}
        up.write(rec)


@dataclass(frozen=True)
class AllowOlder(Command["Uploader", bool]):
    """Whether the job opted in to an older step (it may say so while stage-in waits)."""

    job_id: int

    def apply(self, up: Uploader) -> bool:
        rec = up.jobs.get(self.job_id)
        return rec is not None and rec.get("allow_older_step") is True


@dataclass(frozen=True)
class SyncBegin(Command["Uploader", "tuple[JobRecord, float] | None"]):
    """A job's sync starts: its working copy and its back-off delay. A failed job
    (FAILED_RETRY_S later) gets one more try from the state it failed in."""

    job_id: int

    def apply(self, up: Uploader) -> tuple[JobRecord, float] | None:
        rec = _mine(up, self.job_id, "sync start")
        if rec is None:
            return None
        _, delay = up.backoff.get(self.job_id, (0.0, up.ck.retry_initial_s))
        if rec.get("state") == JobState.FAILED:
            rec["state"] = rec.get("failed_from") or JobState.ACTIVE
        return copy.deepcopy(rec), delay or up.ck.retry_initial_s


@dataclass(frozen=True)
class SyncSucceeded(Command["Uploader", bool]):
    """A job's sync went through: no back-off; True when it clears an earlier failure."""

    job_id: int

    def apply(self, up: Uploader) -> bool:
        up.owner.check("sync result")
        up.backoff.pop(self.job_id, None)
        rec = up.jobs.get(self.job_id)
        if rec is None or not rec.get("error"):
            return False
        for key in ("error", "failed_at", "failed_from"):
            rec.pop(key, None)  # type: ignore[misc]
        up.write(rec)
        return True


@dataclass(frozen=True)
class BackOff(Command["Uploader", None]):
    """A job's sync failed for now: its next try waits ``delay`` (jittered), then twice."""

    job_id: int
    delay: float

    def apply(self, up: Uploader) -> None:
        up.owner.check("back-off")
        jittered = self.delay * random.uniform(0.5, 1.0)  # noqa: S311 - spreads retries
        up.backoff[self.job_id] = (time.monotonic() + jittered,
                                   min(self.delay * 2, up.ck.retry_max_s))


@dataclass(frozen=True)
class FailJob(Command["Uploader", None]):
    """Stop working on a job after an unexpected error (tried again FAILED_RETRY_S
    later); other jobs go on."""

    job_id: int
    why: str

    def apply(self, up: Uploader) -> None:
        rec = _mine(up, self.job_id, "job failure")
        if rec is None:
            return
        if rec.get("state") != JobState.FAILED:
            rec["failed_from"] = rec.get("state")
        rec["state"], rec["error"], rec["failed_at"] = JobState.FAILED, self.why, time.time()
        try:
            up.write(rec)
        except (OSError, TypeError, ValueError) as exc:
            log.error("checkpoint: journal: couldn't record failed job", job_id=self.job_id,
                      error=str(exc))


@dataclass(frozen=True)
class Forget(Command["Uploader", None]):
    """The job is done on this node: its record and per-job bookkeeping go."""

    job_id: int

    def apply(self, up: Uploader) -> None:
        up.owner.check("forget a job")
        up.jobs.pop(self.job_id, None)
        up.journal.delete(self.job_id)
        up.backoff.pop(self.job_id, None)
        up.orphans_checked.pop(self.job_id, None)


@dataclass(frozen=True)
class StaleDue(Command["Uploader", None]):
    """Whether ``.stale/`` should be looked at on the next pass."""

    due: bool

    def apply(self, up: Uploader) -> None:
        up.owner.check("stale flag")
        up.stale_due = self.due


@dataclass(frozen=True)
class OrphansDue(Command["Uploader", bool]):
    """Whether a job's run is due for a look for orphaned multipart uploads (at most
    every ``every_s``); True also notes that the look happens now."""

    job_id: int
    every_s: float

    def apply(self, up: Uploader) -> bool:
        up.owner.check("orphan check")
        if time.monotonic() - up.orphans_checked.get(self.job_id, -1e9) < self.every_s:
            return False
        up.orphans_checked[self.job_id] = time.monotonic()
        return True


@dataclass(frozen=True)
class SpaceView(Command["Uploader", "tuple[list[JobRecord], set[int]]"]):
    """Copies of every record for the space pass, and the jobs uploading now (their steps
    stay this pass; a job without a run URI has nothing to upload, so it holds none)."""

    def apply(self, up: Uploader) -> tuple[list[JobRecord], set[int]]:
        jobs = [copy.deepcopy(r) for r in up.jobs.values()]
        busy = {j for j, t in up.syncing.items() if t.is_alive()
                and j in up.jobs and up.jobs[j].get("uri")}
        return jobs, busy


@dataclass(frozen=True)
class DueJobs(Command["Uploader", "list[int]"]):
    """Jobs to sync now: not failed (or failed FAILED_RETRY_S ago), not backing off, no
    sync in flight."""

    def apply(self, up: Uploader) -> list[int]:
        up.owner.check("due jobs")
        up.syncing = {j: t for j, t in up.syncing.items() if t.is_alive()}
        return up.due()
