"""What the uploader removes: local and S3 steps past retention, an ended job's staging
dir once its steps are safe, and what was set aside under ``.stale/``.

These run on workers (a job's sync, the ``.stale/`` cleaner) over working copies; what
they change in a record reaches it as a report to the record owner (records.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.checkpoint.staging import (
    remove_at,
    remove_job_dir,
    remove_stale,
)
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalIncomplete
from slurm_resilience.uploader import intent
from slurm_resilience.uploader.journal import (
    JobRecord,
    StepState,
    pending_steps,
)
from slurm_resilience.uploader.records import StaleDue
from slurm_resilience.uploader.retention import plan_remote_retention
from slurm_resilience.uploader.rootfs import committed_steps_at
from slurm_resilience.uploader.upload_protocol import ORPHAN_AGE_S

if TYPE_CHECKING:
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.uploader")

PEER_WAIT_S = 3600.0  # an ended job's step whose other ranks never reached S3 is abandoned


def clean_stale(up: Uploader) -> None:
    """One bounded pass over ``.stale/``; what is left waits for the next pass. The
    only remover of ``.stale/`` (one at a time, from ``tick`` or ``run_pass``)."""
    up.tell(StaleDue(False))  # a request that comes during this pass asks for another
    try:
        count = remove_stale(up.staging_root, up.budget())
    except FileNotFoundError:
        return  # no staging root yet: nothing was set aside
    except RemovalIncomplete as exc:
        up.tell(StaleDue(True))
        log.info("leftover staging entries only partly removed; the rest goes next pass",
                 error=str(exc))
        return
    except (CheckpointError, OSError) as exc:  # said once; the next cleanup asks again
        log.warning("checkpoint: couldn't remove leftover staging entries",
                    root=up.staging_root, error=str(exc))
        return
    if count:
        log.info("removed leftover staging entries set aside under .stale/", count=count)


def retain_local(up: Uploader, rec: JobRecord, jfd: int) -> None:
    """Keep the newest ``keep_local`` committed steps; with a URI, older ones go only
    once S3 holds them. Local-only runs keep their newest steps the same way."""
    steps = committed_steps_at(jfd)
    keep = set(steps[-up.ck.keep_local:])
    for step in steps:
        if step in keep:
            continue
        st = rec["steps"].get(str(step), {})
        if rec.get("uri") and st.get("state") not in ("committed", "pruned"):
            continue  # not safe in S3 yet
        try:
            remove_at(jfd, step_name(step), up.budget())
        except RemovalIncomplete as exc:
            log.warning("local step only partly removed; the rest goes next pass",
                        job_id=rec["job_id"], step=step, error=str(exc))
            return
        log.info("removed local step (retention)", job_id=rec["job_id"], step=step)


def retain_remote(up: Uploader, rec: JobRecord, uri: S3Uri) -> None:
    """Keep the run's newest ``keep_remote`` committed steps, over the S3 listing."""
    if up.ck.keep_remote <= 0:
        return
    prefix = uri.join() + "/"
    try:
        objects = up.s3.list_objects(uri.bucket, prefix)
        plan = plan_remote_retention(
            {k[len(prefix):]: v for k, v in objects.items()}, up.ck.keep_remote,
            up.ck.remote_retention_grace_s, ORPHAN_AGE_S, time.time())
        for step in plan:
            sprefix = prefix + step_name(step) + "/"
            keys = sorted(k for k in objects if k.startswith(sprefix))
            marker = sprefix + COMMIT
            # The commit marker goes first, so a half-deleted step is never taken as
            # complete; every other key (intent records too) belongs to the step.
            up.s3.delete_keys(uri.bucket, [k for k in keys if k == marker])
            up.s3.delete_keys(uri.bucket, [k for k in keys if k != marker])
            if str(step) in rec["steps"]:
                rec["steps"][str(step)] = {"state": StepState.PRUNED}
                up.report_step(rec, step)
            log.info("removed S3 step (retention)", job_id=rec["job_id"], step=step,
                     uri=str(uri), keep_remote=up.ck.keep_remote)
    except CheckpointError as exc:  # retention waits; uploads must not
        log.warning("checkpoint: retention: couldn't apply S3 retention", uri=str(uri),
                    job_id=rec["job_id"], error=str(exc))


def finish_ended(up: Uploader, rec: JobRecord) -> None:
    pending = pending_steps(rec)
    age = time.time() - float(rec.get("ended_at") or time.time())
    if pending and age > PEER_WAIT_S and all(
            rec["steps"][str(s)].get("state") == "waiting-peers" for s in pending):
        for s in pending:
            rec["steps"][str(s)]["state"] = StepState.REJECTED
            rec["steps"][str(s)]["reason"] = "other ranks never reached S3"
            intent.withdraw(up.s3, rec, rec["steps"][str(s)], s, up.node)  # intent.py
            up.report_step(rec, s)
        pending = []
    if pending:
        return
    if not rec.get("uri") and age < up.ck.local_only_keep_s:
        return  # local-only: the dir is the only copy; a requeue may still need it
    try:
        removed = remove_job_dir(rec["staging_root"], int(rec["job_id"]), up.budget())
    except RemovalIncomplete as exc:
        log.warning("staging dir of ended job only partly removed; the rest goes next pass",
                    job_id=rec["job_id"], error=str(exc))
        return
    if removed:
        log.info("removed staging dir of ended job", job_id=rec["job_id"],
                 local_only=not rec.get("uri"))
    up.tell(StaleDue(True))  # and what the prolog or the epilog set aside, next pass
    up.forget(rec)
