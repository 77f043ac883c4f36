"""The uploader's requests (unix socket, caller known by SO_PEERCRED); see service.py
for the list. A job's user may only act on their own jobs; job_start, job_end and
cleanup are root's.

A handler checks its arguments, does what I/O it needs, and sends the record owner a
typed command (owner.py), whose ``apply`` runs on the owner thread: the only place a
request reads or changes a job's record. A handler waits a bounded time for the answer;
an owner that doesn't answer in time is the request's error, with the reason."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from slurm_resilience.agent.service import (
    Peer,
    Request,
    RequestError,
    Response,
    int_arg,
    str_arg,
)
from slurm_resilience.checkpoint.commit import (
    CheckpointError,
)
from slurm_resilience.checkpoint.prefix import check_run_uri
from slurm_resilience.checkpoint.staging import (
    open_job_dir,
)
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.uploader.journal import (
    JobRecord,
    JobState,
    StageinState,
    StepState,
    failed_steps,
    new_record,
    pending_steps,
)
from slurm_resilience.uploader.owner import Command, OwnerStopped, OwnerTimeout
from slurm_resilience.uploader.records import StaleDue
from slurm_resilience.uploader.registration import node_names
from slurm_resilience.uploader.restore import fetch_for, stagein_status
from slurm_resilience.uploader.rootfs import committed_steps_at

if TYPE_CHECKING:
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.uploader")
# A job's user sends these requests as often as they like: lines per job are budgeted.
_JOB_LOG = LogBudget(log, "refused or failed requests")

MAX_EXCLUDED = 16  # corrupt steps one job may pass over (ckpt.restage)
T = TypeVar("T")


def ask(up: Uploader, command: Command[Uploader, T]) -> T:
    """Send a request's command to the record owner; no answer in time is the request's
    error, naming what the owner is busy with."""
    try:
        return up.ask(command)
    except (OwnerTimeout, OwnerStopped) as exc:
        log.error("checkpoint: a request got no answer from the record owner",
                  command=type(command).__name__, error=str(exc))
        raise RequestError(f"checkpoint: {exc}") from None


def on_cleanup(up: Uploader, request: Request, peer: Peer) -> Response:
    """``ckpt.cleanup`` (root): remove what is set aside under ``.stale/``, in the
    agent's own time (the next ticks), never in the caller's."""
    if peer.uid != 0:
        raise RequestError(f"checkpoint: only root may ask for a cleanup (you are uid "
                           f"{peer.uid})")
    ask(up, StaleDue(True))
    return {"ok": True, "queued": True}


def owned_record(up: Uploader, job_id: int, uid: int, *, root_only: bool = False
                 ) -> JobRecord:
    """The owner's record of a job the caller (``uid``) may act on (owner thread only)."""
    up.owner.check(f"read job {job_id}'s record")
    if root_only and uid != 0:
        raise RequestError(f"checkpoint: only root may do this (you are uid {uid})")
    rec = up.jobs.get(job_id)
    if rec is None:
        raise RequestError(f"checkpoint: job {job_id} has no staging dir on node "
                           f"{up.node} (did the prolog run?)")
    if uid not in (0, int(rec["uid"])):
        raise RequestError(f"checkpoint: job {job_id} belongs to uid {rec['uid']}, "
                           f"not to you (uid {uid})")
    return rec


@dataclass(frozen=True)
class Lookup(Command["Uploader", JobRecord]):
    """A copy of a job's record, for a caller allowed to see it."""

    job_id: int
    uid: int
    root_only: bool = False

    def apply(self, up: Uploader) -> JobRecord:
        return copy.deepcopy(owned_record(up, self.job_id, self.uid,
                                          root_only=self.root_only))


def job_of(up: Uploader, request: Request, peer: Peer, *, root_only: bool = False) -> JobRecord:
    """A copy of the request's job's record (the caller's to read, never to change)."""
    return ask(up, Lookup(int_arg(request, "job_id"), peer.uid, root_only))


@dataclass(frozen=True)
class JobStart(Command["Uploader", None]):
    job_id: int
    uid: int
    gid: int
    user: str
    uri: str

    def apply(self, up: Uploader) -> None:
        up.owner.check("job start")
        rec = up.jobs.get(self.job_id)
        if rec is None or int(rec["uid"]) != self.uid:
            rec = new_record(self.job_id, self.uid, self.gid, self.user, up.staging_root)
        else:  # a requeued job on the same node
            rec["state"], rec["ended_at"] = JobState.ACTIVE, None
            rec["stagein"] = {"state": StageinState.PENDING}
            rec.pop("stagein_wanted", None)  # a new run of the job: its newest step
        if self.uri and not rec.get("uri"):
            rec["uri"] = self.uri
        up.jobs[self.job_id] = rec
        up.write(rec)
        if rec.get("uri"):
            up.start_stagein(rec)


def on_job_start(up: Uploader, request: Request, peer: Peer) -> Response:
    if peer.uid != 0:
        raise RequestError(f"checkpoint: only root may start a job (you are uid {peer.uid})")
    job_id, uid, gid = (int_arg(request, "job_id"), int_arg(request, "uid"),
                        int_arg(request, "gid"))
    user = str_arg(request, "user", limit=256)
    uri = str_arg(request, "uri", default="")
    refused = ""
    if uri:  # from the SPANK option --ckpt-uri: stage in before the tasks even start
        try:
            uri = str(check_run_uri(uri, up.ck.allowed_prefix, user))
        except CheckpointError as exc:
            refused, uri = str(exc), ""  # the job's own register call reports it
    ask(up, JobStart(job_id, uid, gid, user, uri))
    return {"ok": True, "refused": refused} if refused else {"ok": True}


@dataclass(frozen=True)
class Register(Command["Uploader", None]):
    job_id: int
    uid: int
    run: str
    allow_older: bool
    lost: list[str]

    def apply(self, up: Uploader) -> None:
        rec = owned_record(up, self.job_id, self.uid)
        if rec.get("uri") and rec["uri"] != self.run:
            raise RequestError(f"checkpoint: job {rec['job_id']} already uses {rec['uri']}, "
                               f"not {self.run}")
        rec["uri"] = self.run
        si = rec["stagein"]
        if self.allow_older and not rec.get("allow_older_step"):
            # The job's own opt-in (SLURM_RESILIENCE_CKPT_ALLOW_OLDER_STEP), read by a
            # stage-in still waiting when its wait runs out; one that already failed
            # on that wait runs again (and waits again: the step may have arrived).
            rec["allow_older_step"] = True
            log.warning("job opts in to an older step when a step still uploading "
                        "never completes", job_id=rec["job_id"])
            if si.get("state") == StageinState.FAILED and \
                    si.get("still_uploading") is not None:
                rec["stagein"] = {"state": StageinState.PENDING}
        if self.lost and self.lost != rec.get("unreachable_nodes"):
            # The job's word, about its own run only: shown, never acted on.
            rec["unreachable_nodes"] = self.lost
            _JOB_LOG.log(f"job {rec['job_id']}", "checkpoint: the job's ranks couldn't "
                         "reach the node agent on other nodes; checkpoints saved there stay "
                         "there and no step of the run commits in S3 until those agents "
                         "return", level="error", job_id=rec["job_id"], nodes=self.lost,
                         uri=user_text(self.run))
        up.write(rec)
        if rec["stagein"].get("state") == "pending":
            up.start_stagein(rec)


def on_register(up: Uploader, request: Request, peer: Peer) -> Response:
    rec = job_of(up, request, peer)
    uri = str_arg(request, "uri", default="")
    allow_older = request.get("allow_older_step", False)
    if not isinstance(allow_older, bool):
        raise RequestError(f"allow_older_step must be true or false, got "
                           f"{str(allow_older)[:40]!r}")
    lost = node_names(request.get("unreachable_nodes", []))
    try:
        run = check_run_uri(uri, up.ck.allowed_prefix, str(rec["user"]))
    except CheckpointError as exc:
        _JOB_LOG.log(f"job {rec['job_id']}", "checkpoint: register: run URI refused",
                     job_id=rec["job_id"], uri=user_text(uri), error=user_text(exc))
        raise RequestError(str(exc)) from None
    ask(up, Register(int(rec["job_id"]), peer.uid, str(run), allow_older, lost))
    return {"ok": True, "uri": str(run)}


def on_status(up: Uploader, request: Request, peer: Peer) -> Response:
    rec = job_of(up, request, peer)  # a copy: read here, off the owner thread
    answer = stagein_status(rec)
    failed = {str(k): v for k, v in failed_steps(rec).items()}
    return {"ok": True, **answer, "failed": failed, "upload_error": rec.get("error"),
            "fetch": up.fetcher.stats(int(rec["job_id"])),
            "unreachable_nodes": list(rec.get("unreachable_nodes") or []),
            "staging_quota": up.space.over_quota.get(int(rec["job_id"])),
            "buddy": up.buddy.status(int(rec["job_id"])) if up.buddy is not None else None}


def on_fetch(up: Uploader, request: Request, peer: Peer) -> Response:
    """``ckpt.fetch`` (the job's owner): make byte ranges of a step present (fetch.py)."""
    rec = job_of(up, request, peer)
    try:
        return {"ok": True, **fetch_for(up.fetcher, rec, request)}
    except CheckpointError as exc:
        _JOB_LOG.log(f"job {rec['job_id']}", "checkpoint: fetch: failed", level="error",
                     job_id=rec["job_id"], error=user_text(exc))
        raise RequestError(str(exc)) from None


def _step_arg(request: Request, what: str) -> int:
    step = request.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RequestError(f"checkpoint: {what}: step {step!r} is not a step number")
    return step


@dataclass(frozen=True)
class Restage(Command["Uploader", None]):
    job_id: int
    uid: int
    step: int
    reason: str

    def apply(self, up: Uploader) -> None:
        rec = owned_record(up, self.job_id, self.uid)
        step, reason = self.step, self.reason
        excluded = rec.setdefault("stagein_excluded", {})
        if len(excluded) >= MAX_EXCLUDED and str(step) not in excluded:
            raise RequestError(f"checkpoint: restage: job {rec['job_id']} already passed "
                               f"over {len(excluded)} corrupt steps; not staging again")
        excluded.setdefault(str(step), reason or "the restore found it corrupt")
        si = rec["stagein"]
        if si.get("state") != "running" and si.get("step") == step:
            log.error("restore found the staged step corrupt; staging an older one",
                      job_id=rec["job_id"], step=step, reason=reason)
            up.start_stagein(rec)
        else:
            up.write(rec)


def on_restage(up: Uploader, request: Request, peer: Peer) -> Response:
    """``ckpt.restage`` (the job's owner): the restore found the staged step corrupt
    (a block's CRC32C); stage in again without it. Only the job's own restore is
    affected, so the job's word is enough. Idempotent: every node's local leader asks."""
    rec = job_of(up, request, peer)
    reason = str_arg(request, "reason", default="", limit=1 << 16)[:500]
    step = _step_arg(request, "restage")
    ask(up, Restage(int(rec["job_id"]), peer.uid, step, reason))
    return {"ok": True}


@dataclass(frozen=True)
class JobEnd(Command["Uploader", Response]):
    """The job ended: steps found committed in its staging dir count as pending first."""

    job_id: int
    steps: tuple[int, ...]

    def apply(self, up: Uploader) -> Response:
        rec = owned_record(up, self.job_id, 0)
        new = [s for s in self.steps if str(s) not in rec["steps"]]
        for step in new:
            rec["steps"][str(step)] = {"state": StepState.PENDING, "files": {},
                                       "since": time.time()}
        rec["state"], rec["ended_at"] = JobState.ENDED, time.time()
        up.write(rec)
        up.backoff.pop(self.job_id, None)  # try at once
        up.space_due = 0.0  # its steps may be reclaimable now: tell the gate soon
        return {"ok": True, "pending": pending_steps(rec), "uri": rec.get("uri")}


def on_job_end(up: Uploader, request: Request, peer: Peer) -> Response:
    rec = job_of(up, request, peer, root_only=True)
    steps: tuple[int, ...] = ()
    if rec.get("uri"):
        # Steps committed since the last pass must count as pending before the epilog
        # decides whether the staging dir may go.
        try:
            with open_job_dir(rec["staging_root"], int(rec["job_id"])) as jfd:
                steps = tuple(committed_steps_at(jfd))
        except FileNotFoundError:
            pass
        except (CheckpointError, OSError) as exc:
            raise RequestError(f"checkpoint: job_end: couldn't scan the staging dir of job "
                               f"{rec['job_id']}: {exc}") from None
    return ask(up, JobEnd(int(rec["job_id"]), steps))


@dataclass(frozen=True)
class Stage(Command["Uploader", None]):
    job_id: int
    uid: int
    step: int

    def apply(self, up: Uploader) -> None:
        rec = owned_record(up, self.job_id, self.uid)
        step = self.step
        why = rec.get("stagein_excluded", {}).get(str(step))
        if why is not None:
            raise RequestError(f"checkpoint: stage: the restore found step {step} corrupt "
                               f"({why}); not staging it again")
        si = rec["stagein"]
        if rec.get("stagein_wanted") == step and si.get("state") == "running":
            return
        if si.get("state") == "running":
            raise RequestError(f"checkpoint: stage: job {rec['job_id']}'s stage-in is still "
                               "running; ask again when it is done")
        if si.get("state") == "done" and si.get("step") == step:
            return
        log.warning("staging the step the job's ranks agreed on", job_id=rec["job_id"],
                    step=step, staged=si.get("step"))
        rec["stagein_wanted"] = step
        up.start_stagein(rec)


def on_stage(up: Uploader, request: Request, peer: Peer) -> Response:
    """``ckpt.stage`` (the job's owner): stage in exactly ``step`` from S3. Only the job's
    own restore is affected, so the job's word is enough. Idempotent."""
    rec = job_of(up, request, peer)
    step = _step_arg(request, "stage")
    if not rec.get("uri"):
        raise RequestError(f"checkpoint: stage: job {rec['job_id']} has no run URI: nothing "
                           "to stage in from")
    ask(up, Stage(int(rec["job_id"]), peer.uid, step))
    return {"ok": True}
