"""Planned stops: warn a job's ranks ahead of its time limit, and requeue it once it saved.

Slurm ends a job at its time limit with SIGTERM, then SIGKILL ``KillWait`` later, and a
job ended so (TIMEOUT) is not requeued by ``--requeue``. A job of ours therefore gets a
warning a lead time before its limit (``checkpoint.limit_lead_s``), saves at its next step
boundary, and asks its node's agent to requeue it (see
:mod:`slurm_resilience.checkpoint.interrupt` for the training side).

The warning is sent by this service, on every node, to the ranks that asked for it: a
rank's :class:`~slurm_resilience.checkpoint.CheckpointManager` of a run with a URI arms it
(``limits.arm``, unless the job set ``SLURM_RESILIENCE_LIMIT_WARN=off`` or the process
already handles the signal itself, as with its own ``--signal``). Why not Slurm's own
``--signal``: on Slurm 22.05 a job_submit.lua can neither read nor set it, and Slurm
signals every process of the job's steps, so ``srun torchrun`` would die of it (torchrun
does not handle SIGUSR1). This service signals exactly the processes that armed, by the
pid the kernel gave for the socket's peer, checked again (start time, uid) before each
signal; it reads the job's end time from Slurm, so ``scontrol update TimeLimit`` is
followed.

``limits.stopped``: the job's rank 0 says it saved a step because of a warning (requeue
asked) or a SIGTERM (preemption: Slurm requeues or cancels it itself). Root requeues a
running job that asked; the stop is counted in the metrics (``requeue`` with cause
``time_limit``, or ``planned`` ``preempt``), noted in the job's AdminComment as
``[sr-planned n=2 restart=1]`` and its text, never in the hang count. A "preemption" of
a job Slurm ended at its limit (the warning came too late) is that limit's SIGTERM: the
job saved, so it is requeued as after a warning.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any

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
from slurm_resilience.checkpoint.interrupt import stop_text
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config import Config
from slurm_resilience.hang import evidence, jobrecord
from slurm_resilience.heartbeat import attempt
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.heartbeat.writer import process_start_ticks
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import JobInfo

log = get_logger("limits")

# Signals a rank may ask to be warned with: none of them ends a process that armed it, and
# none is one Slurm or a launcher uses for something else.
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "URG": signal.SIGURG}
MAX_JOBS = 256  # armed jobs kept per node
MAX_PIDS = 1024  # armed processes kept per job (ranks on one node)
END_REFRESH_S = 30.0  # how often a job's end time is read again from Slurm
END_RETRY_S = 2.0  # how soon after a failed read
STOP_KEPT_S = 3600.0  # how long a stop is kept for goodput (it reads it within a tick)
CAUSES = ("time_limit", "preempt")
GRACE_REQUEUE_SINCE = (24, 5)  # slurmctld requeues a job that ends in its grace time
_TOKEN = re.compile(r"\[sr-planned n=(\d+) restart=(\d+)\]")
_TEXT = re.compile(r"(time limit|preempted)[^|]*(\||$)")


@dataclass(frozen=True)
class Armed:
    pid: int
    start: int  # process start time (clock ticks), read by root when it armed
    uid: int
    signum: int


def end_time(job: JobInfo) -> float | None:
    """The job's end time (Unix seconds) from ``scontrol show job`` text or JSON; None when
    Slurm gives none (no time limit)."""
    raw: Any = job.raw
    text = raw.get("EndTime")
    if isinstance(text, str):
        try:
            return datetime.fromisoformat(text).timestamp()
        except ValueError:
            return None
    value = raw.get("end_time")
    if isinstance(value, dict):
        if value.get("infinite") or not value.get("set", True):
            return None
        value = value.get("number")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def preempted(job: JobInfo) -> bool:
    """Whether Slurm chose the job for preemption (its PreemptTime is set)."""
    raw: Any = job.raw
    text = raw.get("PreemptTime")
    if isinstance(text, str):
        return text not in ("", "None", "Unknown")
    value = raw.get("preempt_time")
    if isinstance(value, dict):
        return bool(value.get("set", True)) and bool(value.get("number"))
    return isinstance(value, (int, float)) and value > 0


def at_limit(job: JobInfo) -> bool:
    """Whether Slurm ended ``job`` at its time limit: TIMEOUT, or the reason TimeLimit
    slurmctld gives it then (the text form shows COMPLETING while the steps end). Never a
    cancelled job: scancel also sets the end time to now, so the end time can't tell."""
    if preempted(job):
        return False
    return job.state == "TIMEOUT" or job.reason == "TimeLimit"


def planned_count(admin_comment: str) -> tuple[int, int]:
    """(planned stops so far, the job's Restarts at the last one), from the AdminComment."""
    m = _TOKEN.search(admin_comment)
    return (int(m.group(1)), int(m.group(2))) if m else (0, -1)


def merge_comment(admin_comment: str, n: int, restart: int, text: str) -> str:
    rest = _TEXT.sub("", _TOKEN.sub("", admin_comment))
    rest = re.sub(r"^\s*SR:\s*", "", rest).strip(" |")
    ours = f"[sr-planned n={n} restart={restart}] {text}"
    return f"{ours} | {rest}" if rest else ours


class LimitWatch:
    """The ``limits`` agent service."""

    name = "limits"
    interval_s = 1.0
    # The warning has a deadline: no other service's slow tick may hold it back. The tick
    # shares armed/stops with the handlers under the lock; ends and warned are its own.
    own_thread = True

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter, *,
                 clock: Clock = SystemClock(),
                 kill: Callable[[int, int], None] = os.kill):
        self.cfg = cfg
        self.node = node
        self.adapter = adapter
        self.clock = clock
        self.kill = kill
        self.records_dir = P.records_dir(cfg.node.run_dir, node)
        self.lock = threading.Lock()
        self.armed: dict[int, dict[int, Armed]] = {}
        self.ends: dict[int, tuple[float | None, float]] = {}  # job -> (end, read at)
        self.warned: set[tuple[int, int]] = set()
        # job -> (run, when): the runs that stopped on purpose, for goodput. The ranks' slot
        # flag says so too, but the job may leave the node before any tick reads it.
        self.stops: dict[int, tuple[int, float]] = {}

    # -- requests ----------------------------------------------------------------------------

    def _owner(self, job_id: int, peer: Peer) -> jobrecord.JobRecord:
        records, _ = jobrecord.read_all(self.records_dir)
        for rec in records:
            if rec.job_id == job_id and peer.uid in (0, rec.uid):
                return rec
        raise RequestError(f"no job {job_id} of uid {peer.uid} runs on {self.node}")

    def handle_arm(self, request: Request, peer: Peer) -> Response:
        """A rank asks to be warned ahead of its job's limit, with the signal it handles."""
        job_id = int_arg(request, "job_id")
        name = str_arg(request, "signal", default="USR1", limit=8)
        if name not in SIGNALS:
            raise RequestError(f"signal {name!r}: one of {', '.join(SIGNALS)}")
        rec = self._owner(job_id, peer)
        try:
            start = process_start_ticks(peer.pid)
        except (OSError, ValueError, IndexError) as exc:
            raise RequestError(f"process {peer.pid} is gone") from exc
        with self.lock:
            pids = self.armed.get(job_id)
            if pids is None:
                if len(self.armed) >= MAX_JOBS:
                    raise RequestError(f"{MAX_JOBS} jobs armed on {self.node} already")
                pids = self.armed[job_id] = {}
            if len(pids) >= MAX_PIDS and peer.pid not in pids:
                raise RequestError(f"{MAX_PIDS} processes of job {job_id} armed already")
            pids[peer.pid] = Armed(peer.pid, start, rec.uid, SIGNALS[name])
        return {"lead_s": self.cfg.checkpoint.limit_lead_s}

    def handle_stopped(self, request: Request, peer: Peer) -> Response:
        """Rank 0 saved ``step`` and stops; ``requeue``: requeue the job (a warning before
        its time limit), else Slurm ends or requeues it itself (preemption)."""
        job_id = int_arg(request, "job_id")
        step = int_arg(request, "step")
        cause = str_arg(request, "cause", limit=16)
        if cause not in CAUSES:
            raise RequestError(f"cause {cause!r}: one of {', '.join(CAUSES)}")
        left = request.get("seconds_left")
        seconds_left = float(left) if isinstance(left, (int, float)) and \
            not isinstance(left, bool) and 0 <= left < 1e9 else None
        self._owner(job_id, peer)
        try:
            job = self.adapter.show_job(job_id)
        except SlurmError as exc:
            raise RequestError(f"couldn't read job {job_id}: {exc}") from exc
        requeue = bool(request.get("requeue")) and cause == "time_limit"
        ended = at_limit(job)
        reached = cause == "preempt" and ended
        if reached:
            # The SIGTERM was Slurm's at the limit itself: the warning came too late (a
            # step slower than the lead) or not at all (no arm, an agent restarted), and
            # the ranks saved in KillWait. A job ended so is TIMEOUT, which --requeue does
            # not restart: requeued here as after a warning, or the run would be lost.
            cause, requeue = "time_limit", True
        run = request.get("run")  # the attempt, relaunches included; older clients: Restarts
        self._note_stop(job_id, run if isinstance(run, int) and not isinstance(run, bool)
                        and 0 <= run <= attempt.MAX_ATTEMPT else job.restarts)
        if cause == "preempt" and job.state == "CANCELLED":
            # scancel sends SIGTERM too: the step is saved, but no restart follows.
            log.warning(f"limits: job {job_id}: cancelled: saved step {step:,}", job_id=job_id)
            return {"requeued": False, "text": f"cancelled: saved step {step:,}", "why": ""}
        mode = self._preempt_mode(job) if cause == "preempt" and preempted(job) else ""
        if "REQUEUE" in mode:
            # Up to 23.11 a job that ends within its grace time ends by its exit code, not
            # requeued: the job saved, so it goes back to the queue now. Under CANCEL it
            # just ends.
            requeue = True
        why = ""
        # Past the limit Slurm has ended the job already (TIMEOUT, shown COMPLETING while
        # its steps end): root may requeue it still, as long as slurmctld keeps its record.
        if requeue and job.state not in (("RUNNING", "COMPLETING", "TIMEOUT") if ended
                                         else ("RUNNING",)):
            requeue, why = False, f"the job is {job.state}"
        elif requeue and not job.requeue:
            requeue, why = False, "the job is not requeueable (--no-requeue)"
        n, last = planned_count(job.admin_comment)
        text = stop_text(cause, step, seconds_left, requeue, reached=reached)
        if "CANCEL" in mode:
            text += ", the job ends (PreemptMode=CANCEL)"
        if requeue and cause == "preempt" and self._slurm_requeues_preempted():
            # 24.05 on, Slurm requeues a --requeue job that ends in its grace time itself,
            # and only then forgets the preemption: after a requeue of ours it would still
            # hold it and requeue the next run as well when that one ends.
            pass
        elif requeue:
            try:
                self.adapter.requeue(job_id, cause=cause)
            except SlurmError as exc:
                requeue, why = False, f"requeue failed: {exc}"
                text = stop_text(cause, step, seconds_left, False, reached=reached)
        from slurm_resilience import events

        events.count(self.adapter.events_path, events.PLANNED, cause)
        if last != job.restarts:
            try:
                self.adapter.set_admin_comment(job_id, merge_comment(
                    job.admin_comment, n + 1, job.restarts, text))
            except SlurmError as exc:
                log.warning("limits: couldn't note the stop in the job", job_id=job_id,
                            error=str(exc))
        log.warning(f"limits: job {job_id}: {text}" + (f" (not requeued: {why})" if why else ""),
                    job_id=job_id, step=step, cause=cause)
        return {"requeued": requeue, "text": text, "why": why}

    def _note_stop(self, job_id: int, run: int) -> None:
        with self.lock:
            self.stops.pop(job_id, None)
            while len(self.stops) >= MAX_JOBS:
                del self.stops[next(iter(self.stops))]  # the oldest
            self.stops[job_id] = (run, self.clock.monotonic())

    def stopped_runs(self) -> Mapping[int, int]:
        """Each job's run that saved and stopped on purpose (a frozen copy)."""
        with self.lock:
            return MappingProxyType({j: run for j, (run, _) in self.stops.items()})

    def _slurm_requeues_preempted(self) -> bool:
        """Whether slurmctld requeues a job that ends within its preemption grace time
        (PreemptMode=REQUEUE, the job requeueable): from Slurm 24.05 on."""
        try:
            return self.adapter.slurm_version() >= GRACE_REQUEUE_SINCE
        except SlurmError as exc:
            log.warning("limits: couldn't read the Slurm version; requeueing the preempted "
                        "job ourselves", error=str(exc))
            return False

    def _preempt_mode(self, job: JobInfo) -> str:
        """What preemption does to ``job``: its partition's PreemptMode (``REQUEUE``,
        ``CANCEL``...), which Slurm falls back to the cluster's for a partition that sets
        none; the cluster's when the job names no partition. "" (nothing is requeued here:
        Slurm ends or requeues the job by its own mode) when unreadable, or under
        preempt/qos, where the job's QOS decides and this service does not read QOS."""
        try:
            conf = self.adapter.show_config()
            if "qos" in conf.get("PreemptType", "").lower():
                log.warning("limits: PreemptType is preempt/qos: the QOS's PreemptMode "
                            "applies; not read here, so the job is not requeued by us",
                            job_id=job.job_id)
                return ""
            if job.partition:
                return self.adapter.preempt_mode(job.partition)
            return conf.get("PreemptMode", "").upper()
        except (SlurmError, ValueError) as exc:
            log.warning("limits: couldn't read the PreemptMode", job_id=job.job_id,
                        partition=job.partition, error=str(exc))
            return ""

    # -- the tick ----------------------------------------------------------------------------

    def _end(self, job_id: int, now: float) -> float | None:
        known = self.ends.get(job_id)
        if known is not None and now - known[1] < END_REFRESH_S:
            return known[0]
        try:
            end = end_time(self.adapter.show_job(job_id))
        except SlurmError as exc:
            log.warning("limits: couldn't read the job's end time", job_id=job_id,
                        error=str(exc))
            # Read again in END_RETRY_S, not END_REFRESH_S: a job whose end is unknown
            # gets no warning meanwhile.
            end = known[0] if known else None
            self.ends[job_id] = (end, now - END_REFRESH_S + END_RETRY_S)
            return end
        self.ends[job_id] = (end, now)
        return end

    def tick(self) -> None:
        records, _ = jobrecord.read_all(self.records_dir)
        running = {r.job_id for r in records}
        now = self.clock.time()
        lead = self.cfg.checkpoint.limit_lead_s
        with self.lock:
            for job_id in set(self.armed) - running:
                del self.armed[job_id]
                self.ends.pop(job_id, None)
            self.warned = {w for w in self.warned if w[0] in running}
            # Kept past the job's end: goodput may read a stop after the job left the node.
            old = self.clock.monotonic() - STOP_KEPT_S
            self.stops = {j: s for j, s in self.stops.items() if s[1] >= old}
            jobs = {j: list(p.values()) for j, p in self.armed.items()}
        for job_id, procs in jobs.items():
            if lead <= 0 or all((job_id, a.pid) in self.warned for a in procs):
                continue
            end = self._end(job_id, now)
            if end is None or now < end - lead:
                continue
            for a in procs:
                if (job_id, a.pid) in self.warned:
                    continue
                self.warned.add((job_id, a.pid))
                if not evidence.same_process(a.pid, a.start, a.uid):
                    continue
                try:
                    self.kill(a.pid, a.signum)
                except ProcessLookupError:
                    continue
                log.info("limits: warned a rank ahead of the time limit", job_id=job_id,
                         pid=a.pid, seconds_left=round(end - now, 1))

    def handlers(self) -> dict[str, Handler]:
        return {"limits.arm": self.handle_arm, "limits.stopped": self.handle_stopped}

    def close(self) -> None:
        return None


def factory(ctx: AgentContext) -> LimitWatch | None:
    """The agent's ``limits`` service: off with ``checkpoint.limit_lead_s: 0``."""
    if ctx.cfg.checkpoint.limit_lead_s <= 0:
        return None
    return LimitWatch(ctx.cfg, ctx.node, ctx.adapter)
