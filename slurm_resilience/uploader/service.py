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

``tick`` hands one pass over all jobs to a worker thread: upload each committed
step (files, then rank manifests, then COMMIT.json once every rank's manifest
in S3 carries the step's save id), then apply retention. An upload whose save
is no longer the step's newest in S3 (a later save of the same step number
exists or committed it) stops before each file and manifest it would write.
Jobs are synced side by side (at most ``MAX_JOB_THREADS`` at once) and their
parts share one fair pool, so a huge upload does not hold a small one back. A
failure inside one job's work is logged and marks that job (or that step) failed
with the reason; the pass goes on.
"""

from __future__ import annotations

import copy
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from slurm_resilience.agent.service import (
    AgentContext,
    Handler,
    Peer,
    Request,
    RequestError,
    Response,
    int_arg,
    str_arg,
)
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Crc32c,
    Manifest,
    parse_rank,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri, check_run_uri, parse_uri
from slurm_resilience.checkpoint.staging import (
    open_dir_at,
    open_job_dir,
    open_owned_file,
    remove_at,
    remove_job_dir,
    remove_stale,
)
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.nofollow import RemovalBudget, RemovalIncomplete
from slurm_resilience.uploader import intent
from slurm_resilience.uploader.journal import (
    DONE_STATES,
    JobRecord,
    JobState,
    Journal,
    StageinState,
    StepState,
    failed_steps,
    new_record,
    pending_steps,
)
from slurm_resilience.uploader.registration import node_names
from slurm_resilience.uploader.restore import fetch_for, make_fetcher, run_stagein, stagein_status
from slurm_resilience.uploader.retention import plan_remote_retention
from slurm_resilience.uploader.rootfs import committed_steps_at, read_small, read_step
from slurm_resilience.uploader.s3 import (
    S3,
    ContentMismatch,
    PermanentS3Error,
    S3Error,
    S3Settings,
    TransientS3Error,
    error_code,
)
from slurm_resilience.uploader.space import SpaceKeeper
from slurm_resilience.uploader.stage_agreed import on_stage

log = get_logger("checkpoint.uploader")
# A job's user sends these requests as often as they like: lines per job are budgeted.
_JOB_LOG = LogBudget(log, "refused or failed requests")

MAX_EXCLUDED = 16  # corrupt steps one job may pass over (ckpt.restage)
PEER_WAIT_S = 3600.0  # an ended job's step whose other ranks never reached S3 is abandoned
ORPHAN_AGE_S = 24 * 3600.0
MAX_JOB_THREADS = 16  # jobs synced at once; their parts share the S3 fair pool
FAILED_RETRY_S = 3600.0  # a job whose upload work failed is tried again after this long
SPACE_EVERY_S = 10.0  # staging-disk passes (quota, eviction, the reclaimable record)


class SaveSuperseded(CheckpointError):
    """Another save of the step owns it in S3 (committed it, or a newer save is under
    way): this upload stops before writing anything more."""


class CommittedBySave(Exception):
    """Our own save of the step is already committed in S3 (another node wrote it)."""


def s3_settings(cfg: Config) -> S3Settings:
    ck = cfg.checkpoint
    return S3Settings(endpoint=ck.s3_endpoint, region=ck.s3_region,
                      credentials_file=ck.s3_credentials_file, part_size=int(ck.part_size),
                      concurrency=ck.concurrency, rate_limit=int(ck.rate_limit),
                      retry_initial_s=ck.retry_initial_s, retry_max_s=ck.retry_max_s,
                      request_timeout_s=ck.request_timeout_s)


class Uploader:
    """The ``checkpoint`` service of the node agent."""

    name = "checkpoint"

    def __init__(self, cfg: Config, node: str, s3: S3 | None = None):
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.node = node
        self.interval_s = self.ck.upload_interval_s
        self.staging_root = node_path(self.ck.staging_root, node)
        jdir = self.ck.journal_dir or os.path.join(cfg.node.state_dir, "ckpt-journal")
        self.journal = Journal(node_path(jdir, node))
        self.jobs: dict[int, JobRecord] = self.journal.load_all()
        self._s3 = s3
        self.lock = threading.RLock()
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
        for rec in self.jobs.values():
            if rec.get("stagein", {}).get("state") == "running":
                rec["stagein"] = {"state": StageinState.PENDING}  # cut by a restart: redo it
        log.info("checkpoint uploader started", jobs=sorted(self.jobs),
                 pending={j: pending_steps(r) for j, r in self.jobs.items() if pending_steps(r)})

    @property
    def s3(self) -> S3:
        if self._s3 is None:
            self._s3 = S3(s3_settings(self.cfg))
        return self._s3

    # -- requests ---------------------------------------------------------------------------

    def handlers(self) -> dict[str, Handler]:
        return {"ckpt.job_start": self.on_job_start, "ckpt.register": self.on_register,
                "ckpt.status": self.on_status, "ckpt.job_end": self.on_job_end,
                "ckpt.fetch": self.on_fetch, "ckpt.restage": self.on_restage,
                "ckpt.cleanup": self.on_cleanup,
                "ckpt.stage": lambda request, peer: on_stage(self, request, peer)}

    def on_cleanup(self, request: Request, peer: Peer) -> Response:
        """``ckpt.cleanup`` (root): remove what is set aside under ``.stale/``, in the
        agent's own time (the next ticks), never in the caller's."""
        if peer.uid != 0:
            raise RequestError(f"checkpoint: only root may ask for a cleanup (you are uid "
                               f"{peer.uid})")
        self.stale_due = True
        return {"ok": True, "queued": True}

    def clean_stale(self) -> None:
        """One bounded pass over ``.stale/``; what is left waits for the next pass. The
        only remover of ``.stale/`` (one at a time, from ``tick`` or ``run_pass``)."""
        self.stale_due = False  # a request that comes during this pass asks for another
        try:
            count = remove_stale(self.staging_root, self._budget())
        except FileNotFoundError:
            return  # no staging root yet: nothing was set aside
        except RemovalIncomplete as exc:
            self.stale_due = True
            log.info("leftover staging entries only partly removed; the rest goes next pass",
                     error=str(exc))
            return
        except (CheckpointError, OSError) as exc:  # said once; the next cleanup asks again
            log.warning("checkpoint: couldn't remove leftover staging entries",
                        root=self.staging_root, error=str(exc))
            return
        if count:
            log.info("removed leftover staging entries set aside under .stale/", count=count)

    def _job(self, request: Request, peer: Peer, *, root_only: bool = False) -> JobRecord:
        job_id = int_arg(request, "job_id")
        if root_only and peer.uid != 0:
            raise RequestError(f"checkpoint: only root may do this (you are uid {peer.uid})")
        rec = self.jobs.get(job_id)
        if rec is None:
            raise RequestError(f"checkpoint: job {job_id} has no staging dir on node "
                               f"{self.node} (did the prolog run?)")
        if peer.uid not in (0, int(rec["uid"])):
            raise RequestError(f"checkpoint: job {job_id} belongs to uid {rec['uid']}, "
                               f"not to you (uid {peer.uid})")
        return rec

    def on_job_start(self, request: Request, peer: Peer) -> Response:
        if peer.uid != 0:
            raise RequestError(f"checkpoint: only root may start a job (you are uid {peer.uid})")
        job_id, uid, gid = (int_arg(request, "job_id"), int_arg(request, "uid"),
                            int_arg(request, "gid"))
        user = str_arg(request, "user", limit=256)
        uri = str_arg(request, "uri", default="")
        refused = ""
        if uri:  # from the SPANK option --ckpt-uri: stage in before the tasks even start
            try:
                uri = str(check_run_uri(uri, self.ck.allowed_prefix, user))
            except CheckpointError as exc:
                refused, uri = str(exc), ""  # the job's own register call reports it
        with self.lock:
            rec = self.jobs.get(job_id)
            if rec is None or int(rec["uid"]) != uid:
                rec = new_record(job_id, uid, gid, user, self.staging_root)
            else:  # a requeued job on the same node
                rec["state"], rec["ended_at"] = JobState.ACTIVE, None
                rec["stagein"] = {"state": StageinState.PENDING}
                rec.pop("stagein_wanted", None)  # a new run of the job: its newest step
            if uri and not rec.get("uri"):
                rec["uri"] = uri
            self.jobs[job_id] = rec
            self.journal.write(rec)
            if rec.get("uri"):
                self._start_stagein(rec)
        return {"ok": True, "refused": refused} if refused else {"ok": True}

    def on_register(self, request: Request, peer: Peer) -> Response:
        rec = self._job(request, peer)
        uri = str_arg(request, "uri", default="")
        allow_older = request.get("allow_older_step", False)
        if not isinstance(allow_older, bool):
            raise RequestError(f"allow_older_step must be true or false, got "
                               f"{str(allow_older)[:40]!r}")
        lost = node_names(request.get("unreachable_nodes", []))
        try:
            run = check_run_uri(uri, self.ck.allowed_prefix, str(rec["user"]))
        except CheckpointError as exc:
            _JOB_LOG.log(f"job {rec['job_id']}", "checkpoint: register: run URI refused",
                         job_id=rec["job_id"], uri=user_text(uri), error=user_text(exc))
            raise RequestError(str(exc)) from None
        with self.lock:
            if rec.get("uri") and rec["uri"] != str(run):
                raise RequestError(f"checkpoint: job {rec['job_id']} already uses {rec['uri']}, "
                                   f"not {run}")
            rec["uri"] = str(run)
            si = rec["stagein"]
            if allow_older and not rec.get("allow_older_step"):
                # The job's own opt-in (SLURM_RESILIENCE_CKPT_ALLOW_OLDER_STEP), read by a
                # stage-in still waiting when its wait runs out; one that already failed
                # on that wait runs again (and waits again: the step may have arrived).
                rec["allow_older_step"] = True
                log.warning("job opts in to an older step when a step still uploading "
                            "never completes", job_id=rec["job_id"])
                if si.get("state") == StageinState.FAILED and \
                        si.get("still_uploading") is not None:
                    rec["stagein"] = {"state": StageinState.PENDING}
            if lost and lost != rec.get("unreachable_nodes"):
                # The job's word, about its own run only: shown, never acted on.
                rec["unreachable_nodes"] = lost
                _JOB_LOG.log(f"job {rec['job_id']}", "checkpoint: the job's ranks couldn't "
                             "reach the node agent on other nodes; checkpoints saved there stay "
                             "there and no step of the run commits in S3 until those agents "
                             "return", level="error", job_id=rec["job_id"], nodes=lost,
                             uri=user_text(run))
            self.journal.write(rec)
            if rec["stagein"].get("state") == "pending":
                self._start_stagein(rec)
        return {"ok": True, "uri": str(run)}

    def on_status(self, request: Request, peer: Peer) -> Response:
        rec = self._job(request, peer)
        with self.lock:
            answer = stagein_status(rec)
            failed = {str(k): v for k, v in failed_steps(rec).items()}
            error = rec.get("error")
        return {"ok": True, **answer, "failed": failed, "upload_error": error,
                "fetch": self.fetcher.stats(int(rec["job_id"])),
                "unreachable_nodes": list(rec.get("unreachable_nodes") or []),
                "staging_quota": self.space.over_quota.get(int(rec["job_id"]))}

    def on_fetch(self, request: Request, peer: Peer) -> Response:
        """``ckpt.fetch`` (the job's owner): make byte ranges of a step present (fetch.py)."""
        rec = self._job(request, peer)
        try:
            return {"ok": True, **fetch_for(self.fetcher, rec, request)}
        except CheckpointError as exc:
            _JOB_LOG.log(f"job {rec['job_id']}", "checkpoint: fetch: failed", level="error",
                         job_id=rec["job_id"], error=user_text(exc))
            raise RequestError(str(exc)) from None

    def on_restage(self, request: Request, peer: Peer) -> Response:
        """``ckpt.restage`` (the job's owner): the restore found the staged step corrupt
        (a block's CRC32C); stage in again without it. Only the job's own restore is
        affected, so the job's word is enough. Idempotent: every node's local leader asks."""
        rec = self._job(request, peer)
        step, reason = request.get("step"), str_arg(request, "reason", default="",
                                                    limit=1 << 16)[:500]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RequestError(f"checkpoint: restage: step {step!r} is not a step number")
        with self.lock:
            excluded = rec.setdefault("stagein_excluded", {})
            if len(excluded) >= MAX_EXCLUDED and str(step) not in excluded:
                raise RequestError(f"checkpoint: restage: job {rec['job_id']} already passed "
                                   f"over {len(excluded)} corrupt steps; not staging again")
            excluded.setdefault(str(step), reason or "the restore found it corrupt")
            si = rec["stagein"]
            if si.get("state") != "running" and si.get("step") == step:
                log.error("restore found the staged step corrupt; staging an older one",
                          job_id=rec["job_id"], step=step, reason=reason)
                self._start_stagein(rec)
            else:
                self.journal.write(rec)
        return {"ok": True}

    def on_job_end(self, request: Request, peer: Peer) -> Response:
        rec = self._job(request, peer, root_only=True)
        if rec.get("uri"):
            # Steps committed since the last pass must count as pending before the epilog
            # decides whether the staging dir may go.
            try:
                with open_job_dir(rec["staging_root"], int(rec["job_id"])) as jfd:
                    self._note_local_steps(rec, jfd)
            except FileNotFoundError:
                pass
            except (CheckpointError, OSError) as exc:
                raise RequestError(f"checkpoint: job_end: couldn't scan the staging dir of job "
                                   f"{rec['job_id']}: {exc}") from None
        with self.lock:
            rec["state"], rec["ended_at"] = JobState.ENDED, time.time()
            self.journal.write(rec)
            self.backoff.pop(int(rec["job_id"]), None)  # try at once
            self.space_due = 0.0  # its steps may be reclaimable now: tell the gate soon
            return {"ok": True, "pending": pending_steps(rec), "uri": rec.get("uri")}

    # -- stage-in ---------------------------------------------------------------------------

    def _start_stagein(self, rec: JobRecord) -> None:
        job_id = int(rec["job_id"])
        rec["stagein"] = {"state": StageinState.RUNNING, "started": time.time()}
        self.journal.write(rec)
        t = threading.Thread(target=self._stagein, args=(rec,), name=f"stagein-{job_id}",
                             daemon=True)
        self.stageins[job_id] = t
        t.start()

    def _stagein(self, rec: JobRecord) -> None:
        started = float(rec["stagein"].get("started") or time.time())
        result = run_stagein(self, rec)
        with self.lock:
            # When it ran, for the metrics (stage-in time) and goodput.
            rec["stagein"] = {**result, "started": started, "finished": time.time()}
            self.journal.write(rec)
        log.info("stage-in finished", job_id=rec["job_id"], **result)

    # -- uploads ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Start a sync for every due job that has none in flight (at most
        ``MAX_JOB_THREADS``): a job that appears while a huge upload runs starts at once,
        and its parts take turns with the huge one's in the fair pool."""
        if self.stopping.is_set():
            return
        with self.lock:
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
            for rec in self._due():
                if len(self.syncing) >= MAX_JOB_THREADS:
                    break
                job_id = int(rec["job_id"])
                t = threading.Thread(target=self._sync_guarded, args=(rec,),
                                     name=f"ckpt-job-{job_id}", daemon=True)
                self.syncing[job_id] = t
                t.start()

    def _due(self) -> list[JobRecord]:
        """Jobs to sync now: not failed, not backing off, no sync in flight (under lock)."""
        now, wall = time.monotonic(), time.time()
        return [rec for job_id, rec in sorted(self.jobs.items())
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
        with self.lock:
            self.syncing = {j: t for j, t in self.syncing.items() if t.is_alive()}
            due = self._due()
        if not due or self.stopping.is_set():
            return
        with ThreadPoolExecutor(max_workers=min(MAX_JOB_THREADS, len(due)),
                                thread_name_prefix="ckpt-job") as pool:
            for _ in pool.map(self._sync_guarded, due):
                pass

    def keep_space(self) -> None:
        """Quota, eviction under pressure, the reclaimable record (space.py)."""
        with self.lock:
            jobs = [copy.deepcopy(r) for r in self.jobs.values()]  # sync threads change them
            # A job uploading now keeps its steps this pass; a job without a run URI has
            # nothing to upload, so its sync never holds its steps back.
            busy = {j for j, t in self.syncing.items() if t.is_alive()
                    and j in self.jobs and self.jobs[j].get("uri")}
        try:
            self.space.run(jobs, busy)
        except (CheckpointError, OSError) as exc:
            log.error("checkpoint: space: couldn't check the staging disk", error=str(exc))

    def _sync_guarded(self, rec: JobRecord) -> None:
        """Sync one job; whatever goes wrong stays with this job."""
        if self.stopping.is_set():
            return
        job_id = int(rec["job_id"])
        _, delay = self.backoff.get(job_id, (0.0, self.ck.retry_initial_s))
        delay = delay or self.ck.retry_initial_s
        if rec.get("state") == JobState.FAILED:  # FAILED_RETRY_S later: one more try
            with self.lock:
                rec["state"] = rec.get("failed_from") or JobState.ACTIVE
        try:
            self.sync_job(rec)
            self.backoff.pop(job_id, None)
            if rec.get("error"):
                with self.lock:
                    rec.pop("error", None)
                    rec.pop("failed_at", None)
                    rec.pop("failed_from", None)
                    self.journal.write(rec)
                log.info("upload work of a failed job went through this time", job_id=job_id)
        except TransientS3Error as exc:
            self._back_off(job_id, delay)
            log.warning("S3 unreachable; uploads wait", job_id=job_id,
                        retry_in_s=round(delay, 1), pending=pending_steps(rec), error=str(exc))
        except (CheckpointError, OSError) as exc:
            log.error("checkpoint sync failed", job_id=job_id, error=str(exc))
            self._back_off(job_id, delay)
        except Exception as exc:  # noqa: BLE001 - a bug or a hostile tree: this job only
            if self.stopping.is_set():  # cancelled parts at shutdown: not the job's fault
                log.info("upload interrupted by shutdown", job_id=job_id, error=repr(exc))
                return
            self._fail_job(rec, f"{type(exc).__name__}: {exc}")

    def _back_off(self, job_id: int, delay: float) -> None:
        jittered = delay * random.uniform(0.5, 1.0)  # noqa: S311 - spreads retries, not crypto
        self.backoff[job_id] = (time.monotonic() + jittered,
                                min(delay * 2, self.ck.retry_max_s))

    def _fail_job(self, rec: JobRecord, why: str) -> None:
        """Stop working on a job after an unexpected error (tried again FAILED_RETRY_S
        later); other jobs go on."""
        log.exception("checkpoint: upload: couldn't sync job; marked failed, other jobs go on",
                      job_id=rec["job_id"], reason=why, pending=pending_steps(rec))
        with self.lock:
            if rec.get("state") != JobState.FAILED:
                rec["failed_from"] = rec.get("state")
            rec["state"], rec["error"], rec["failed_at"] = JobState.FAILED, why, time.time()
            try:
                self.journal.write(rec)
            except (OSError, TypeError, ValueError) as exc:
                log.error("checkpoint: journal: couldn't record failed job", job_id=rec["job_id"],
                          error=str(exc))

    def sync_job(self, rec: JobRecord) -> None:
        job_id = int(rec["job_id"])
        root = rec["staging_root"]
        try:
            with open_job_dir(root, job_id) as jfd:
                if os.fstat(jfd).st_uid != int(rec["uid"]):
                    raise CheckpointError(f"checkpoint: job {job_id}: staging dir is not owned "
                                          f"by uid {rec['uid']}")
                if rec["uri"] and rec["stagein"].get("state") not in ("running", "pending"):
                    uri = parse_uri(rec["uri"])
                    self._note_local_steps(rec, jfd)  # pending even while S3 is down
                    try:
                        self._abort_orphans(rec, uri)
                    except PermanentS3Error as exc:  # housekeeping: uploads still go on
                        log.warning("checkpoint: upload: couldn't look for orphaned uploads",
                                    job_id=job_id, error=str(exc))
                    for step in committed_steps_at(jfd):
                        st = rec["steps"].get(str(step), {})
                        if st.get("state") in DONE_STATES and not self._new_save(rec, jfd,
                                                                                   step):
                            continue
                        try:
                            self.upload_step(rec, jfd, uri, step)
                        except ContentMismatch as exc:
                            self._reject(rec, step, str(exc))
                        except PermanentS3Error as exc:
                            self._reject(rec, step, str(exc), StepState.FAILED)
                    self._retain_remote(rec, uri)
                self._retain_local(rec, jfd)
        except FileNotFoundError:
            if rec["state"] == JobState.ENDED:
                self._forget(rec)
            return
        if rec["state"] == JobState.ENDED:
            self._finish_ended(rec)

    def _note_local_steps(self, rec: JobRecord, jfd: int) -> None:
        changed = False
        with self.lock:
            for step in committed_steps_at(jfd):
                if str(step) not in rec["steps"]:
                    rec["steps"][str(step)] = {"state": StepState.PENDING, "files": {},
                                               "since": time.time()}
                    changed = True
            if changed:
                self.journal.write(rec)

    def _new_save(self, rec: JobRecord, jfd: int, step: int) -> bool:
        """Whether the local step is a new save of a step whose journal entry is finished
        (rejected or failed for an earlier save, e.g. one stage-in set aside before the
        job saved the step again): the entry starts over for the new save."""
        st = rec["steps"].get(str(step), {})
        if "save_id" not in st or st.get("state") not in (StepState.REJECTED,
                                                          StepState.FAILED):
            return False
        try:
            marker, _ = read_step(jfd, step, int(rec["uid"]))
        except (CheckpointError, OSError):
            return False
        if marker.save_id == st["save_id"]:
            return False
        log.info("a new save of a step whose earlier save was not uploaded; uploading it",
                 job_id=rec["job_id"], step=step, save_id=marker.save_id,
                 earlier_save_id=st["save_id"], earlier_state=str(st.get("state")))
        with self.lock:
            rec["steps"][str(step)] = {"state": StepState.PENDING, "files": {},
                                       "since": time.time()}
            self.journal.write(rec)
        return True

    def _check_save(self, uri: S3Uri, step: int, save_id: str) -> None:
        """Raise SaveSuperseded when another save owns ``step`` in S3: its COMMIT.json
        holds another save id, or a newer save of the step is announced (``SAVE-<id>``);
        CommittedBySave when our own save is committed there already. Called before
        every file and manifest an upload writes, so an agent that comes back with an
        old upload stops before it touches a newer save's keys. Legacy uploads (no save
        id) keep the older rule (``upload_step``), except that any save with an id is
        newer than them."""
        sname = step_name(step)
        newer = sorted(i for i in intent.saves_of(self.s3, uri, step) if i > save_id)
        if not save_id:
            if newer:
                raise SaveSuperseded(f"{uri}/{sname}: a newer save of step {step} is in S3 "
                                     f"(save {newer[-1]}); this upload (written before "
                                     "save ids) stops and is not mixed into it")
            return
        commit_key = uri.join(sname, COMMIT)
        try:
            body = self.s3.get_bytes(uri.bucket, commit_key, limit=1024**2)
        except S3Error as exc:
            if error_code(exc.__cause__ or exc) not in ("NoSuchKey", "404", "NotFound"):
                raise
            body = None
        if body is not None:
            theirs = CommitMarker.from_json(body, f"{uri}/{sname}/{COMMIT}")
            if theirs.save_id == save_id:
                raise CommittedBySave()
            raise SaveSuperseded(f"{uri}/{sname} is already committed in S3 by another save "
                                 f"(save {theirs.save_id or '(legacy, none)'}, ours "
                                 f"{save_id}); this upload stops and is not mixed into it")
        if newer:
            raise SaveSuperseded(f"{uri}/{sname}: a newer save of step {step} is under way "
                                 f"in S3 (save {newer[-1]}, ours {save_id}); this upload "
                                 "stops and is not mixed into it")

    def upload_step(self, rec: JobRecord, jfd: int, uri: S3Uri, step: int) -> None:
        uid = int(rec["uid"])
        sname = step_name(step)
        steps = rec["steps"]
        st = steps.setdefault(str(step), {"state": StepState.PENDING, "files": {},
                                          "since": time.time()})
        st.setdefault("files", {})
        try:
            marker, manifests = read_step(jfd, step, uid)
        except (CheckpointError, OSError) as exc:
            self._reject(rec, step, f"unreadable commit marker or manifest: {exc}")
            return
        save_id = marker.save_id
        stale = {r: m.save_id for r, m in manifests.items() if m.save_id != save_id}
        if stale:  # left in the step dir by an abandoned save: never uploaded with this one
            log.warning("rank parts of another save in the local step dir; not uploaded",
                        job_id=rec["job_id"], step=step, save_id=save_id, stale=stale)
            manifests = {r: m for r, m in manifests.items() if r not in stale}
            if not manifests:
                self._reject(rec, step, f"no rank part of this node belongs to the step's "
                                        f"save {save_id or '(legacy, none)'} ({stale})")
                return
        st["save_id"] = save_id
        st["world_size"] = marker.world_size
        st["bytes"] = sum(f.size for m in manifests.values() for f in m.files)  # the backlog
        commit_key = uri.join(sname, COMMIT)
        if not save_id and not any(f.get("done") for f in st["files"].values()) and \
                self.s3.head(uri.bucket, commit_key) is not None:
            # Another job of this run committed this step: never mix our files into it.
            self._reject(rec, step, f"{uri}/{sname} is already committed in S3 by another "
                                    "job of this run; ours is not uploaded", StepState.FAILED,
                         delete_ours=False)
            return
        try:
            self._check_save(uri, step, save_id)
            intent.announce(self.s3, uri, rec, st, marker, sorted(manifests), self.node)
            uploaded = self._upload_parts(rec, jfd, uri, step, manifests)
        except (SaveSuperseded, CommittedBySave) as exc:
            self._settle_not_ours(rec, step, uri, exc)
            return
        if uploaded:
            self._commit(rec, uri, step, marker, manifests)

    def _upload_parts(self, rec: JobRecord, jfd: int, uri: S3Uri, step: int,
                      manifests: dict[int, Manifest]) -> bool:
        """Every file of this node's ranks, then each rank's manifest, each written only
        after ``_check_save`` found the step still ours in S3. False when the step was
        rejected on the way (it must not be committed)."""
        uid, sname, st = int(rec["uid"]), step_name(step), rec["steps"][str(step)]
        save_id = str(st.get("save_id", ""))

        def check() -> None:
            self._check_save(uri, step, save_id)

        sfd = open_dir_at(jfd, sname)
        try:
            for rank, manifest in manifests.items():
                for f in manifest.files:
                    key = uri.join(sname, rank_name(rank), f.path)
                    frec = st["files"].setdefault(key, {"done": False})
                    if frec["done"]:
                        continue
                    check()
                    try:
                        fd = open_owned_file(sfd, f"{rank_name(rank)}/{f.path}", uid)
                    except (CheckpointError, OSError) as exc:
                        self._reject(rec, step, f"{rank_name(rank)}/{f.path}: {exc}")
                        return False
                    try:
                        if os.fstat(fd).st_size != f.size:
                            self._reject(rec, step, f"{rank_name(rank)}/{f.path}: size "
                                         f"{os.fstat(fd).st_size}, manifest says {f.size}")
                            return False
                        self.s3.upload_fd(fd, f.size, f.crc32c, uri.bucket, key, frec,
                                          lambda: self.journal.write(rec), blocks=f.blocks,
                                          block_size=f.block_size, owner=f"job-{rec['job_id']}",
                                          lock=self.lock, before_write=check)
                    finally:
                        os.close(fd)
                    frec["done"] = True
                    self.journal.write(rec)
                mkey = uri.join(sname, rank_name(rank), MANIFEST)
                if not st["files"].get(mkey, {}).get("done"):
                    body = read_small(sfd, f"{rank_name(rank)}/{MANIFEST}", uid)
                    if Manifest.from_json(body, mkey).save_id != save_id:
                        raise CheckpointError(f"checkpoint: upload: {sname}/{rank_name(rank)}"
                                              f"/{MANIFEST} changed while uploading")
                    crc = Crc32c()
                    crc.update(body)
                    check()
                    self.s3.put_bytes(uri.bucket, mkey, body, crc.hexdigest())
                    st["files"][mkey] = {"done": True}
                    self.journal.write(rec)
        finally:
            os.close(sfd)
        return True

    def _commit(self, rec: JobRecord, uri: S3Uri, step: int, marker: CommitMarker,
                manifests: dict[int, Manifest]) -> None:
        """COMMIT.json goes up last, once every rank (from every node) has its manifest in
        S3 and every one of them carries the marker's save id: a manifest another save of
        the step left there is never counted (it is overwritten when its rank's node of
        this save uploads it)."""
        sname, st = step_name(step), rec["steps"][str(step)]
        commit_key = uri.join(sname, COMMIT)
        prefix = uri.join(sname) + "/"
        keys = self.s3.list_keys(uri.bucket, prefix)
        have = {r for r in range(marker.world_size)
                if f"{prefix}{rank_name(r)}/{MANIFEST}" in keys}
        stale: dict[int, str] = {}
        if len(have) == marker.world_size and marker.save_id:
            for r in sorted(have):
                mkey = f"{prefix}{rank_name(r)}/{MANIFEST}"
                try:
                    theirs = Manifest.from_json(self.s3.get_bytes(uri.bucket, mkey), mkey)
                except CheckpointError as exc:
                    if isinstance(exc, TransientS3Error):
                        raise
                    stale[r] = f"unreadable ({exc})"
                    continue
                if theirs.save_id != marker.save_id:
                    stale[r] = theirs.save_id or "(legacy, none)"
            if stale:
                log.warning("manifests of another save of this step are in S3; not counted "
                            "(each is overwritten when its rank's node of this save uploads)",
                            job_id=rec["job_id"], step=step, save_id=marker.save_id,
                            stale_ranks=stale)
            have -= set(stale)
        if len(have) < marker.world_size:
            st["state"] = StepState.WAITING_PEERS
            self.journal.write(rec)
            log.info("step waits for other nodes' ranks", job_id=rec["job_id"], step=step,
                     ranks_in_s3=len(have), world_size=marker.world_size,
                     save_id=marker.save_id)
            return
        try:
            self._check_save(uri, step, marker.save_id)
        except (SaveSuperseded, CommittedBySave) as exc:
            self._settle_not_ours(rec, step, uri, exc)
            return
        body = marker.to_json()
        crc = Crc32c()
        crc.update(body)
        if not self.s3.put_if_absent(uri.bucket, commit_key, body, crc.hexdigest(),
                                     prefix=uri.join() + "/"):
            # Another node of this job got there first (same marker), or another job did.
            existing = self.s3.get_bytes(uri.bucket, commit_key, limit=1024**2)
            if existing != body:
                self._reject(rec, step, f"{uri}/{sname}: a different commit marker is already "
                                    "in S3 (another job of this run)", StepState.FAILED,
                         delete_ours=False)
                return
            log.info("commit marker already in S3 (another node of the job wrote it)",
                     job_id=rec["job_id"], step=step)
        self._committed(rec, step, uri, "step committed in S3")
        self._clean_beyond(uri, step, marker)

    def _settle_not_ours(self, rec: JobRecord, step: int, uri: S3Uri,
                         found: SaveSuperseded | CommittedBySave) -> None:
        """What ``_check_save`` found ends this upload: another save owns the step (failed,
        nothing of it deleted: the keys are shared), or this save is committed already."""
        if isinstance(found, CommittedBySave):
            self._committed(rec, step, uri, "committed in S3 by another node of this save")
        else:
            self._reject(rec, step, str(found), StepState.FAILED, delete_ours=False,
                         withdraw=True)

    def _committed(self, rec: JobRecord, step: int, uri: S3Uri, what: str) -> None:
        st = rec["steps"][str(step)]
        st["state"] = StepState.COMMITTED
        st["files"] = {}
        st["committed_at"] = time.time()
        self.journal.write(rec)
        log.info(what, job_id=rec["job_id"], step=step, uri=str(uri),
                 save_id=st.get("save_id", ""))

    def _clean_beyond(self, uri: S3Uri, step: int, marker: CommitMarker) -> None:
        """Rank dirs of the step beyond its world size are an earlier save's (a job of
        another size): nothing reads them; they go, with a log line. Best effort."""
        prefix = uri.join(step_name(step)) + "/"
        try:
            keys = self.s3.list_keys(uri.bucket, prefix)
            extra = sorted(k for k in keys
                           if (r := parse_rank(k[len(prefix):].partition("/")[0])) is not None
                           and r >= marker.world_size)
            if extra:
                log.info("removing rank parts an earlier save of the step left beyond its "
                         "world size", step=step, world_size=marker.world_size,
                         keys=len(extra), save_id=marker.save_id)
                self.s3.delete_keys(uri.bucket, extra)
        except CheckpointError as exc:
            log.warning("couldn't remove an earlier save's leftover rank parts", step=step,
                        error=str(exc))

    def abandon_step(self, rec: JobRecord, step: int, why: str) -> None:
        """Stage-in passed over a local step and set it aside: a pending upload of it will
        never finish (its intent is withdrawn, its objects go); ``.stale/`` is cleaned
        on the next pass."""
        self.stale_due = True
        st = rec["steps"].get(str(step))
        if st is not None and st.get("state") not in DONE_STATES:
            self._reject(rec, step, why)

    def _reject(self, rec: JobRecord, step: int, why: str,
                state: StepState = StepState.REJECTED, *, delete_ours: bool = True,
                withdraw: bool = False) -> None:
        """A step we must not upload (a link, a foreign file, a bad manifest, bytes that
        don't match it) or that S3 refused for good (``FAILED``): never retried. Its
        unfinished uploads are aborted and, with ``delete_ours``, the objects it had
        completed are deleted (never committed, they would only take space)."""
        log.error("checkpoint: upload: couldn't upload step; it will not be retried",
                  job_id=rec["job_id"], step=step, state=state.value, reason=why)
        old = rec["steps"].get(str(step), {})
        if delete_ours or withdraw:  # a step another job committed keeps its intents
            intent.withdraw(self.s3, rec, old, step, self.node)  # intent.py: never waited for
        if rec["uri"]:
            uri = parse_uri(rec["uri"])
            for key, frec in old.get("files", {}).items():
                try:
                    if frec.get("upload_id"):  # never completed: do not leave it behind
                        self.s3.abort(uri.bucket, key, frec["upload_id"])
                    elif frec.get("done") and delete_ours:
                        self.s3.delete_keys(uri.bucket, [key])
                except CheckpointError as exc:
                    log.warning("couldn't clean up after a step that will not be uploaded",
                                key=key, error=str(exc))
        rec["steps"][str(step)] = {"state": state, "reason": why}
        if "save_id" in old:  # a later save of the step number is uploaded anew
            rec["steps"][str(step)]["save_id"] = old["save_id"]
        self.journal.write(rec)

    def _abort_orphans(self, rec: JobRecord, uri: S3Uri) -> None:
        """Abort multipart uploads under the run that no journal record will finish."""
        job_id = int(rec["job_id"])
        if time.monotonic() - self.orphans_checked.get(job_id, -1e9) < 600:
            return
        self.orphans_checked[job_id] = time.monotonic()
        ours: dict[str, str] = {}
        for st in rec["steps"].values():
            for key, frec in st.get("files", {}).items():
                if frec.get("upload_id"):
                    ours[key] = frec["upload_id"]
        for key, upload_id, age in self.s3.multipart_uploads(uri.bucket, uri.join() + "/"):
            # Another id for a key we upload is ours from before a crash; other keys may be
            # another node's upload in progress, so those only go once they are a day old.
            stale = age is not None and age > ORPHAN_AGE_S and key not in ours
            if (key in ours and ours[key] != upload_id) or stale:
                log.info("aborting orphaned multipart upload", key=key, upload_id=upload_id,
                         age_s=age)
                self.s3.abort(uri.bucket, key, upload_id)

    def _budget(self) -> RemovalBudget:
        return RemovalBudget(max_entries=self.ck.remove_max_entries,
                             max_seconds=self.ck.remove_max_s)

    def _retain_local(self, rec: JobRecord, jfd: int) -> None:
        """Keep the newest ``keep_local`` committed steps; with a URI, older ones go only
        once S3 holds them. Local-only runs keep their newest steps the same way."""
        steps = committed_steps_at(jfd)
        keep = set(steps[-self.ck.keep_local:])
        for step in steps:
            if step in keep:
                continue
            st = rec["steps"].get(str(step), {})
            if rec.get("uri") and st.get("state") not in ("committed", "pruned"):
                continue  # not safe in S3 yet
            try:
                remove_at(jfd, step_name(step), self._budget())
            except RemovalIncomplete as exc:
                log.warning("local step only partly removed; the rest goes next pass",
                            job_id=rec["job_id"], step=step, error=str(exc))
                return
            log.info("removed local step (retention)", job_id=rec["job_id"], step=step)

    def _retain_remote(self, rec: JobRecord, uri: S3Uri) -> None:
        """Keep the run's newest ``keep_remote`` committed steps, over the S3 listing."""
        if self.ck.keep_remote <= 0:
            return
        prefix = uri.join() + "/"
        try:
            objects = self.s3.list_objects(uri.bucket, prefix)
            plan = plan_remote_retention(
                {k[len(prefix):]: v for k, v in objects.items()}, self.ck.keep_remote,
                self.ck.remote_retention_grace_s, ORPHAN_AGE_S, time.time())
            for step in plan:
                sprefix = prefix + step_name(step) + "/"
                keys = sorted(k for k in objects if k.startswith(sprefix))
                marker = sprefix + COMMIT
                # The commit marker goes first, so a half-deleted step is never taken as
                # complete; every other key (intent records too) belongs to the step.
                self.s3.delete_keys(uri.bucket, [k for k in keys if k == marker])
                self.s3.delete_keys(uri.bucket, [k for k in keys if k != marker])
                with self.lock:
                    if str(step) in rec["steps"]:
                        rec["steps"][str(step)] = {"state": StepState.PRUNED}
                        self.journal.write(rec)
                log.info("removed S3 step (retention)", job_id=rec["job_id"], step=step,
                         uri=str(uri), keep_remote=self.ck.keep_remote)
        except CheckpointError as exc:  # retention waits; uploads must not
            log.warning("checkpoint: retention: couldn't apply S3 retention", uri=str(uri),
                        job_id=rec["job_id"], error=str(exc))

    def _finish_ended(self, rec: JobRecord) -> None:
        pending = pending_steps(rec)
        age = time.time() - float(rec.get("ended_at") or time.time())
        if pending and age > PEER_WAIT_S and all(
                rec["steps"][str(s)].get("state") == "waiting-peers" for s in pending):
            for s in pending:
                rec["steps"][str(s)]["state"] = StepState.REJECTED
                rec["steps"][str(s)]["reason"] = "other ranks never reached S3"
                intent.withdraw(self.s3, rec, rec["steps"][str(s)], s, self.node)  # intent.py
            pending = []
        if pending:
            return
        if not rec.get("uri") and age < self.ck.local_only_keep_s:
            return  # local-only: the dir is the only copy; a requeue may still need it
        try:
            removed = remove_job_dir(rec["staging_root"], int(rec["job_id"]), self._budget())
        except RemovalIncomplete as exc:
            log.warning("staging dir of ended job only partly removed; the rest goes next pass",
                        job_id=rec["job_id"], error=str(exc))
            return
        if removed:
            log.info("removed staging dir of ended job", job_id=rec["job_id"],
                     local_only=not rec.get("uri"))
        self.stale_due = True  # and what the prolog or the epilog set aside, next pass
        self._forget(rec)

    def _forget(self, rec: JobRecord) -> None:
        job_id = int(rec["job_id"])
        self.fetcher.forget(job_id)
        with self.lock:
            self.jobs.pop(job_id, None)
            self.journal.delete(job_id)
            self.backoff.pop(job_id, None)  # per-job bookkeeping goes with the job
            self.orphans_checked.pop(job_id, None)

    def close(self) -> None:
        self.stopping.set()
        self.fetcher.close()
        if self._s3 is not None:
            self._s3.close()  # queued parts are cancelled; parts in flight finish
        deadline = time.monotonic() + 5
        for t in list(self.syncing.values()):
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def factory(ctx: AgentContext) -> Uploader | None:
    """The agent's service factory: None when checkpoint staging is disabled."""
    if not ctx.cfg.checkpoint.enabled:
        return None
    return Uploader(ctx.cfg, ctx.node)
