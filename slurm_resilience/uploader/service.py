"""The agent's checkpoint service: register jobs, stage in, upload committed steps, retain.

Requests (unix socket, caller known by SO_PEERCRED):

* ``ckpt.job_start`` (root, from the prolog): the job's owner and staging root;
* ``ckpt.register`` (the job's user): the run URI; checked against the user's
  allowed prefix, then stage-in starts;
* ``ckpt.status`` (the job's user or root): stage-in state and pending steps;
* ``ckpt.job_end`` (root, from the epilog): the job ended; the agent keeps
  uploading what is pending, then removes the staging dir.
* ``ckpt.cleanup`` (root, from the epilog): a staging dir too big to remove within the
  epilog's budget was set aside under ``.stale/``; the agent removes it on its next passes,
  a bounded share each time (also after a restart: it looks at start).

The requests live in upload_requests.py, the upload of one step in upload_protocol.py,
retention and removals in upload_retention.py; this module runs the threads.

``tick`` hands one pass over all jobs to a worker thread: upload each committed
step (files, then rank manifests, then COMMIT.json once every rank's manifest
in S3 carries the step's save id), then apply retention. An upload whose save
is no longer the step's newest in S3 (a later save of the same step number
exists or committed it) stops before each file and manifest it would write.
Jobs are synced side by side (at most ``MAX_JOB_THREADS`` at once) and their
parts share one fair pool, so a huge upload does not hold a small one back. A
failure inside one job's work is logged and marks that job (or that step) failed
with the reason; the pass goes on.

Ownership: the journal records and their bookkeeping belong to one thread (owner.py);
request handlers and workers send it typed commands (records.py, upload_requests.py)
and wait a bounded time for the answer. A worker does its I/O on a working copy the
owner handed out and reports each change of a step as a frozen copy; only the owner
changes a record or writes the journal, and metrics read snapshots it makes.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from slurm_resilience.agent.service import (
    AgentContext,
    Handler,
    Peer,
    Request,
    Response,
)
from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.prefix import S3Uri, parse_uri
from slurm_resilience.checkpoint.staging import open_job_dir
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalBudget
from slurm_resilience.uploader import upload_protocol as protocol
from slurm_resilience.uploader import upload_requests as requests
from slurm_resilience.uploader import upload_retention as retention
from slurm_resilience.uploader.announce import announce_now
from slurm_resilience.uploader.journal import (
    DONE_STATES,
    JobRecord,
    JobState,
    Journal,
    StageinState,
    StepState,
    pending_steps,
)
from slurm_resilience.uploader.owner import Command, Owner, OwnerStopped, OwnerTimeout
from slurm_resilience.uploader.records import (
    BackOff,
    DueJobs,
    FailJob,
    Forget,
    NoteSteps,
    RecordCopy,
    Snapshot,
    SpaceView,
    StageinFinished,
    StepReport,
    SyncBegin,
    SyncSucceeded,
)
from slurm_resilience.uploader.records import (
    UploaderSnapshot as UploaderSnapshot,
)
from slurm_resilience.uploader.restore import make_fetcher, run_stagein
from slurm_resilience.uploader.rootfs import committed_steps_at
from slurm_resilience.uploader.s3 import (
    S3,
    ContentMismatch,
    PermanentS3Error,
    S3Settings,
    TransientS3Error,
)
from slurm_resilience.uploader.space import SpaceKeeper

if TYPE_CHECKING:
    from slurm_resilience.uploader.buddy_service import BuddyService

log = get_logger("checkpoint.uploader")
T = TypeVar("T")

MAX_JOB_THREADS = 16  # jobs synced at once; their parts share the S3 fair pool
FAILED_RETRY_S = 3600.0  # a job whose upload work failed is tried again after this long
SPACE_EVERY_S = 10.0  # staging-disk passes (quota, eviction, the reclaimable record)


def s3_settings(cfg: Config) -> S3Settings:
    ck = cfg.checkpoint
    return S3Settings(endpoint=ck.s3_endpoint, region=ck.s3_region,
                      credentials_file=ck.s3_credentials_file, part_size=int(ck.part_size),
                      concurrency=ck.concurrency, rate_limit=int(ck.rate_limit),
                      retry_initial_s=ck.retry_initial_s, retry_max_s=ck.retry_max_s,
                      request_timeout_s=ck.request_timeout_s)


# A request waits this share of the client's own bound (agent.request_timeout_s) for
# the record owner's answer, so the client hears why rather than timing out itself.
OWNER_SHARE = 0.8
WORKER_TIMEOUT_S = 600.0  # a worker's report waits this long (the owner does no S3 I/O)


class Uploader:
    """The ``checkpoint`` service of the node agent.

    Ownership: ``jobs`` (the journal records) and the bookkeeping beside them
    (``syncing``, ``stageins``, ``backoff``, ``orphans_checked``, ``stale_due``,
    ``space_due``) belong to one thread, ``owner``; everyone else sends it commands
    (records.py, and the requests' in upload_requests.py). Workers do their I/O on
    working copies and report what they found; only the owner writes the journal."""

    name = "checkpoint"

    def __init__(self, cfg: Config, node: str, s3: S3 | None = None,
                 owner_timeout_s: float | None = None):
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.node = node
        self.interval_s = self.ck.upload_interval_s
        self.staging_root = node_path(self.ck.staging_root, node)
        jdir = self.ck.journal_dir or os.path.join(cfg.node.state_dir, "ckpt-journal")
        self.journal = Journal(node_path(jdir, node))
        self.jobs: dict[int, JobRecord] = self.journal.load_all()
        self._s3 = s3
        self.syncing: dict[int, threading.Thread] = {}  # job -> its sync in flight
        self.stageins: dict[int, threading.Thread] = {}
        self.backoff: dict[int, tuple[float, float]] = {}  # job → (next try, delay)
        self.orphans_checked: dict[int, float] = {}
        self.stopping = threading.Event()
        self.stale_due = True  # .stale/ may hold what a killed agent or the epilog left
        self.cleaning: threading.Thread | None = None
        self.space = SpaceKeeper(cfg, node)  # quota and eviction (space.py)
        self.spacing: threading.Thread | None = None
        self.space_due = 0.0
        self.fetcher = make_fetcher(cfg, lambda: self.s3)
        # The buddy service (buddy_service.py) sets itself here: stage-in and status ask it.
        self.buddy: BuddyService | None = None
        for rec in self.jobs.values():
            if rec.get("stagein", {}).get("state") == "running":
                rec["stagein"] = {"state": StageinState.PENDING}  # cut by a restart: redo it
        log.info("checkpoint uploader started", jobs=sorted(self.jobs),
                 pending={j: pending_steps(r) for j, r in self.jobs.items() if pending_steps(r)})
        self._ticking: Future[None] | None = None  # the agent's tick, queued to the owner
        if owner_timeout_s is None:
            owner_timeout_s = OWNER_SHARE * cfg.agent.request_timeout_s
        self.owner: Owner[Uploader] = Owner(self, f"ckpt-records-{node}", owner_timeout_s)

    @property
    def s3(self) -> S3:
        if self._s3 is None:
            self._s3 = S3(s3_settings(self.cfg))
        return self._s3

    def ask(self, command: Command[Uploader, T], timeout_s: float | None = None) -> T:
        """Run a command on the record owner and wait for its answer (owner.py)."""
        return self.owner.ask(command, timeout_s)

    def tell(self, command: Command[Uploader, T]) -> T:
        """A worker's report: applied by the owner, its errors raised here as before."""
        return self.owner.ask(command, WORKER_TIMEOUT_S)

    def write(self, rec: JobRecord) -> None:
        """Persist a record (owner thread only)."""
        self.owner.check(f"journal write of job {rec.get('job_id')}")
        self.journal.write(rec)

    def snapshot(self) -> UploaderSnapshot:
        return self.ask(Snapshot())

    def current(self, job_id: int) -> JobRecord | None:
        """A fresh working copy of a job's record, None once it is forgotten."""
        return self.tell(RecordCopy(job_id))

    def report_step(self, rec: JobRecord, step: int) -> None:
        """Hand the owner this worker's state of one step (a frozen copy)."""
        doc = rec["steps"].get(str(step))
        if doc is not None:
            self.tell(StepReport(int(rec["job_id"]), step, copy.deepcopy(doc)))

    # -- requests ---------------------------------------------------------------------------

    def handlers(self) -> dict[str, Handler]:
        return {"ckpt.job_start": self.on_job_start, "ckpt.register": self.on_register,
                "ckpt.status": self.on_status, "ckpt.job_end": self.on_job_end,
                "ckpt.fetch": self.on_fetch, "ckpt.restage": self.on_restage,
                "ckpt.cleanup": self.on_cleanup,
                "ckpt.stage": lambda request, peer: requests.on_stage(self, request, peer)}

    # The requests themselves live in upload_requests.py.
    def on_job_start(self, request: Request, peer: Peer) -> Response:
        return requests.on_job_start(self, request, peer)

    def on_register(self, request: Request, peer: Peer) -> Response:
        return requests.on_register(self, request, peer)

    def on_status(self, request: Request, peer: Peer) -> Response:
        return requests.on_status(self, request, peer)

    def on_job_end(self, request: Request, peer: Peer) -> Response:
        return requests.on_job_end(self, request, peer)

    def on_fetch(self, request: Request, peer: Peer) -> Response:
        return requests.on_fetch(self, request, peer)

    def on_restage(self, request: Request, peer: Peer) -> Response:
        return requests.on_restage(self, request, peer)

    def on_cleanup(self, request: Request, peer: Peer) -> Response:
        return requests.on_cleanup(self, request, peer)

    def clean_stale(self) -> None:
        """One bounded pass over ``.stale/`` (upload_retention.py)."""
        retention.clean_stale(self)

    def upload_step(self, rec: JobRecord, jfd: int, uri: S3Uri, step: int) -> None:
        """Upload one committed step and commit it in S3 (upload_protocol.py)."""
        protocol.upload_step(self, rec, jfd, uri, step)

    def abandon_step(self, rec: JobRecord, step: int, why: str) -> None:
        """Stage-in set the local step aside: its upload never finishes (upload_protocol.py)."""
        protocol.abandon_step(self, rec, step, why)

    # -- stage-in ---------------------------------------------------------------------------

    def start_stagein(self, rec: JobRecord) -> None:
        """Mark the stage-in running and start it on its own thread (owner thread only:
        called by the requests' commands)."""
        self.owner.check("start a stage-in")
        job_id = int(rec["job_id"])
        started = time.time()
        rec["stagein"] = {"state": StageinState.RUNNING, "started": started}
        self.write(rec)
        t = threading.Thread(target=self._stagein, args=(copy.deepcopy(rec), started),
                             name=f"stagein-{job_id}", daemon=True)
        self.stageins[job_id] = t
        t.start()

    def _stagein(self, rec: JobRecord, started: float) -> None:
        result = run_stagein(self, rec)
        self.tell(StageinFinished(int(rec["job_id"]), result, started))
        log.info("stage-in finished", job_id=rec["job_id"], **result)

    # -- uploads ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Start a sync for every due job that has none in flight (at most
        ``MAX_JOB_THREADS``): a job that appears while a huge upload runs starts at once,
        and its parts take turns with the huge one's in the fair pool."""
        if self.stopping.is_set():
            return
        if self._ticking is not None and not self._ticking.done():
            return  # the last one is still queued: the owner is busy, one is enough
        self._ticking = self.owner.post(_Tick())

    def start_due(self) -> None:
        """``tick``'s work, on the owner thread: start what is due."""
        self.owner.check("start syncs")
        if self.stale_due and not (self.cleaning and self.cleaning.is_alive()):
            self.cleaning = threading.Thread(target=self.clean_stale, name="ckpt-stale",
                                             daemon=True)
            self.cleaning.start()
        self.syncing = {j: t for j, t in self.syncing.items() if t.is_alive()}
        if time.monotonic() >= self.space_due and not (self.spacing
                                                      and self.spacing.is_alive()):
            self.space_due = time.monotonic() + SPACE_EVERY_S
            self.spacing = threading.Thread(target=self.keep_space, name="ckpt-space",
                                            daemon=True)
            self.spacing.start()
        for job_id in self.due():
            if len(self.syncing) >= MAX_JOB_THREADS:
                break
            t = threading.Thread(target=self._sync_guarded, args=(job_id,),
                                 name=f"ckpt-job-{job_id}", daemon=True)
            self.syncing[job_id] = t
            t.start()

    def due(self) -> list[int]:
        """Jobs to sync now: not failed, not backing off, no sync in flight (owner only)."""
        self.owner.check("due jobs")
        now, wall = time.monotonic(), time.time()
        return [job_id for job_id, rec in sorted(self.jobs.items())
                if job_id not in self.syncing
                and now >= self.backoff.get(job_id, (0.0, 0.0))[0]
                and (rec.get("state") != JobState.FAILED
                     or wall - float(rec.get("failed_at") or 0.0) >= FAILED_RETRY_S)]

    def run_pass(self) -> None:
        """Sync every due job side by side and wait for them (tests, and tools that want
        one synchronous pass); the agent calls ``tick`` instead."""
        if self.stale_due:
            self.clean_stale()
        self.keep_space()
        due = self.ask(DueJobs())
        if not due or self.stopping.is_set():
            return
        with ThreadPoolExecutor(max_workers=min(MAX_JOB_THREADS, len(due)),
                                thread_name_prefix="ckpt-job") as pool:
            for _ in pool.map(self._sync_guarded, due):
                pass

    def keep_space(self) -> None:
        """Quota, eviction under pressure, the reclaimable record (space.py)."""
        jobs, busy = self.tell(SpaceView())
        try:
            self.space.run(jobs, busy)
        except (CheckpointError, OSError) as exc:
            log.error("checkpoint: space: couldn't check the staging disk", error=str(exc))

    def _sync_guarded(self, job_id: int) -> None:
        """Sync one job on a working copy; whatever goes wrong stays with this job."""
        if self.stopping.is_set():
            return
        begun = self.tell(SyncBegin(job_id))
        if begun is None:
            return
        rec, delay = begun
        try:
            self.sync_job(rec)
            if self.tell(SyncSucceeded(job_id)):
                log.info("upload work of a failed job went through this time", job_id=job_id)
        except TransientS3Error as exc:
            self.fetcher.note_s3_unreachable()
            self.tell(BackOff(job_id, delay))
            log.warning("S3 unreachable; uploads wait", job_id=job_id,
                        retry_in_s=round(delay, 1), pending=pending_steps(rec), error=str(exc))
        except (CheckpointError, OSError) as exc:
            log.error("checkpoint sync failed", job_id=job_id, error=str(exc))
            self.tell(BackOff(job_id, delay))
        except Exception as exc:
            if self.stopping.is_set():  # cancelled parts at shutdown: not the job's fault
                log.info("upload interrupted by shutdown", job_id=job_id, error=repr(exc))
                return
            why = f"{type(exc).__name__}: {exc}"
            log.exception("checkpoint: upload: couldn't sync job; marked failed, other jobs "
                          "go on", job_id=job_id, reason=why, pending=pending_steps(rec))
            self.tell(FailJob(job_id, why))

    def sync_job(self, rec: JobRecord) -> None:
        """One job's sync, on its working copy ``rec``: changes reach the record as
        reports to the owner."""
        job_id = int(rec["job_id"])
        root = rec["staging_root"]
        try:
            with open_job_dir(root, job_id) as jfd:
                if os.fstat(jfd).st_uid != int(rec["uid"]):
                    raise CheckpointError(f"checkpoint: job {job_id}: staging dir is not owned "
                                          f"by uid {rec['uid']}")
                if rec["uri"] and rec["stagein"].get("state") not in ("running", "pending"):
                    uri = parse_uri(rec["uri"])
                    rec = self.note_local_steps(rec, jfd)  # pending even while S3 is down
                    try:
                        protocol.abort_orphans(self, rec, uri)
                    except PermanentS3Error as exc:  # housekeeping: uploads still go on
                        log.warning("checkpoint: upload: couldn't look for orphaned uploads",
                                    job_id=job_id, error=str(exc))
                    for step in committed_steps_at(jfd):
                        st = rec["steps"].get(str(step), {})
                        if st.get("state") in DONE_STATES and \
                                not protocol.new_save(self, rec, jfd, step):
                            continue
                        try:
                            self.upload_step(rec, jfd, uri, step)
                        except ContentMismatch as exc:
                            protocol.reject(self, rec, step, str(exc))
                        except PermanentS3Error as exc:
                            protocol.reject(self, rec, step, str(exc), StepState.FAILED)
                    retention.retain_remote(self, rec, uri)
                retention.retain_local(self, rec, jfd)
        except FileNotFoundError:
            fresh = self.current(job_id)  # a job_end may have come during the sync
            if fresh is not None and fresh["state"] == JobState.ENDED:
                self.forget(fresh)
            return
        fresh = self.current(job_id)
        if fresh is not None and fresh["state"] == JobState.ENDED:
            retention.finish_ended(self, fresh)

    def note_local_steps(self, rec: JobRecord, jfd: int) -> JobRecord:
        """Report the steps committed in the staging dir; a fresh working copy back."""
        fresh = self.tell(NoteSteps(int(rec["job_id"]), tuple(committed_steps_at(jfd))))
        return fresh if fresh is not None else rec

    def budget(self) -> RemovalBudget:
        return RemovalBudget(max_entries=self.ck.remove_max_entries,
                             max_seconds=self.ck.remove_max_s)

    def announce_before_requeue(self, job_id: int) -> str:
        """This node's newest committed step of the job announced in S3, bounded
        (announce.py); '' when it is, else why not (also logged)."""
        return announce_now(self, job_id, self.ck.requeue_announce_wait_s)

    def forget(self, rec: JobRecord) -> None:
        job_id = int(rec["job_id"])
        self.fetcher.forget(job_id)
        self.tell(Forget(job_id))

    def close(self) -> None:
        self.stopping.set()
        self.fetcher.close()
        if self._s3 is not None:
            self._s3.close()  # queued parts are cancelled; parts in flight finish
        deadline = time.monotonic() + 5
        try:
            threads = self.ask(_Threads())
        except (OwnerTimeout, OwnerStopped) as exc:  # closing goes on; said, not hidden
            log.error("checkpoint: closing without waiting for the syncs in flight",
                      error=str(exc))
            threads = []
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.owner.stop()  # what is queued still runs; later commands are refused


@dataclass(frozen=True)
class _Tick(Command[Uploader, None]):
    def apply(self, up: Uploader) -> None:
        up.start_due()


@dataclass(frozen=True)
class _Threads(Command[Uploader, "list[threading.Thread]"]):
    """The syncs in flight (for close to wait on)."""

    def apply(self, up: Uploader) -> list[threading.Thread]:
        return list(up.syncing.values())


def factory(ctx: AgentContext) -> Uploader | None:
    """The agent's service factory: None when checkpoint staging is disabled."""
    if not ctx.cfg.checkpoint.enabled:
        return None
    up = Uploader(ctx.cfg, ctx.node)
    watcher = ctx.extra.get("services", {}).get("heartbeat")
    if watcher is not None:  # a job requeued away from a lost node: our newest step first
        watcher.node_loss.before_requeue = up.announce_before_requeue
    return up
