"""The agent's hang watcher service: reads every job's heartbeat slots on this node each
tick, judges them (pure), and hands a hang to one incident thread
(:mod:`~slurm_resilience.hang.incidentflow`). It also starts incidents other nodes
announced through the :class:`~slurm_resilience.hang.rendezvous.Rendezvous`, verifies
this node when an incident made it a suspect (:mod:`~slurm_resilience.hang.suspect`),
answers socket requests (:mod:`~slurm_resilience.hang.socketapi`) and cleans up.

The tick only reads small files; everything slow runs in threads, one per incident (at most
one per job at a time) and one for verification.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from slurm_resilience.agent.service import (
    AgentContext,
    Handler,
    Peer,
    Request,
    Response,
    int_arg,
)
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.hang import detect, evidence, jobrecord, orphans, socketapi
from slurm_resilience.hang import rendezvous as RV
from slurm_resilience.hang.deathcheck import DeathCheck
from slurm_resilience.hang.incidentflow import IncidentRunner
from slurm_resilience.hang.incidentrecords import Clock, SystemClock
from slurm_resilience.hang.launches import Launches
from slurm_resilience.hang.live import LiveConfig
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.hang.nodelossflow import NodeLossDesk
from slurm_resilience.hang.slotreader import read_slots
from slurm_resilience.hang.store import IncidentStore
from slurm_resilience.hang.suspect import SuspectWatch, Verifier, verify
from slurm_resilience.hang.tune import TunedTimeouts
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.slurm.adapter import SlurmAdapter

log = get_logger("heartbeat")

__all__ = ["HangWatcher", "JobView", "factory", "read_slots"]

# Per-job markers and tuned timeouts outlive requeues; after this long the job is long gone.
STATE_RETENTION_S = 14 * 86400
CLEANUP_EVERY_S = 3600.0
# How long stopping the agent waits for incident threads (systemd and the sandbox allow more).
CLOSE_GRACE_S = 3.0


@dataclass(frozen=True)
class WatcherSnapshot:
    """What other services (metrics) read of the watcher: copied under its own lock."""

    jobs: Mapping[int, JobView]  # views are replaced whole, never changed in place
    open_incidents: tuple[int, ...]  # jobs whose hang incident is being handled now


class HangWatcher:
    """The ``heartbeat`` agent service."""

    name = "heartbeat"

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter, *,
                 clock: Clock | None = None, sleep: Callable[[float], object] | None = None,
                 rendezvous: RV.Rendezvous | None = None, verifier: Verifier = verify,
                 config_path: str | None = None):
        self.live = LiveConfig(cfg, config_path)
        self.node = node
        self.adapter = adapter
        self.clock: Clock = clock or SystemClock()
        self.records_dir = P.records_dir(cfg.node.run_dir, node)
        self.state_dir = os.path.join(node_path(cfg.node.state_dir, node), "heartbeat")
        hb = cfg.heartbeat
        self.incident_dir = (node_path(hb.incident_dir, node) if hb.incident_dir
                             else os.path.join(node_path(cfg.node.state_dir, node), "incidents"))
        self.jobs: dict[int, JobView] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.lock = threading.Lock()
        self.tuned = TunedTimeouts(self.state_dir)
        self.store = IncidentStore(os.path.join(self.state_dir, "acted"), hb.max_handled)
        self._own_rdv = rendezvous is None  # a reload may rebuild only what we made
        self.rdv = (rendezvous if rendezvous is not None
                    else RV.make(cfg, node, adapter.node_addresses))
        # Outside network mode: an exchange for other services' messages only (exchange()).
        self._side_exchange: Any = None
        # Set by close(): retry waits end at once and incidents are left for the next start.
        self.stopping = threading.Event()
        self.launches = Launches(self.clock)
        self.runner = IncidentRunner(lambda: self.cfg, node, adapter, self.rdv, self.store,
                                     self.clock, sleep or self.stopping.wait, self.incident_dir,
                                     self.stopping.is_set, self.launches)
        self.node_loss = NodeLossDesk(lambda: self.cfg, self.launches, adapter, self.clock,
                                      node)
        self.suspects = SuspectWatch(cfg, node, adapter, self.clock, self.state_dir, verifier)
        self.death_check = DeathCheck(lambda: self.cfg, node, adapter, self.clock)
        self.next_cleanup = 0.0
        self.next_orphan_check = 0.0
        self.orphan_thread: threading.Thread | None = None
        # A user decides how many of their slots are refused, and how often stragglers change.
        self.slot_log = LogBudget(log, "refused heartbeat slots", clock=self.clock)
        self.straggler_log = LogBudget(log, "changes of straggler ranks",
                                       clock=self.clock)
        for progress in self.store.unfinished():
            self._spawn(-1 - len(self.threads), self.runner.resume, progress)

    @property
    def cfg(self) -> Config:
        return self.live.cfg

    @property
    def interval_s(self) -> float:
        return self.cfg.heartbeat.interval_s

    def _maybe_remake_rendezvous(self, before: Any) -> None:
        """A reload that changes how agents exchange observations takes effect at once."""
        hb = self.cfg.heartbeat
        if not self._own_rdv or (before.rendezvous, before.rendezvous_dir, before.exchange) == \
                (hb.rendezvous, hb.rendezvous_dir, hb.exchange):
            return
        self._close_side_exchange()  # its port may be the network rendezvous's now
        old, self.rdv = self.rdv, RV.make(self.cfg, self.node, self.adapter.node_addresses)
        self.runner.rdv = self.rdv
        old.close()
        log.info("heartbeat: rendezvous rebuilt after a reload", mode=hb.rendezvous)

    def exchange(self) -> Any:
        """The agents' network exchange other services add message kinds to (straggler
        nodes): the hang rendezvous itself in network mode; in directory mode one of its own
        on the same port and munge settings, refusing hang pieces, made on first use; None
        in mode none (the site runs no exchange between agents)."""
        from slurm_resilience.hang import netrendezvous as exchange

        if isinstance(self.rdv, exchange.NetworkRendezvous):
            return self.rdv
        hb = self.cfg.heartbeat
        if hb.rendezvous != "directory" or not self._own_rdv:
            return None
        if self._side_exchange is None:
            try:
                self._side_exchange = exchange.from_config(
                    hb.exchange, self.node, self.adapter.node_addresses, hang=False)
            except OSError as exc:
                log.error("heartbeat: exchange: couldn't listen; other agents' straggler "
                          "summaries won't reach this one", port=hb.exchange.port_of(self.node),
                          error=str(exc))
                self._side_exchange = exchange.from_config(
                    hb.exchange, self.node, self.adapter.node_addresses, listen=False,
                    hang=False)
        return self._side_exchange

    def _close_side_exchange(self) -> None:
        if self._side_exchange is not None:
            self._side_exchange.close()
            self._side_exchange = None

    # -- the tick --------------------------------------------------------------------------------

    def tick(self) -> None:
        before = self.cfg.heartbeat
        if self.live.reload():
            self.suspects.cfg = self.cfg
            self._maybe_remake_rendezvous(before)
        # The agent's one adapter follows `mode` as the file changes (observe ⇄ enforce),
        # for every service that acts through it, without a restart.
        self.adapter.observe = self.cfg.mode == "observe"
        hb = self.cfg.heartbeat
        if hb.mode == "off":
            return
        records, errors = jobrecord.read_all(self.records_dir)
        for err in errors:
            log.warning("couldn't read job record", error=err)
        seen = set()
        for rec in records:
            seen.add(rec.job_id)
            self.watch(rec)
        for job_id, run, node in self.rdv.announced():
            with self.lock:
                view = self.jobs.get(job_id)
            if view is not None and view.verdict.mode != "off":
                self.start_incident(view, f"hang seen on {node}", run=run, remote=True)
        with self.lock:
            for job_id in set(self.jobs) - seen:
                del self.jobs[job_id]
                self.tuned.forget(job_id)
            self.launches.forget(seen)
            self.threads = {k: t for k, t in self.threads.items() if t.is_alive()}
        self.suspects.tick()
        self._check_orphans()
        if self.clock.monotonic() >= self.next_cleanup:
            self.next_cleanup = self.clock.monotonic() + CLEANUP_EVERY_S
            self.cleanup(self.clock.time() - STATE_RETENTION_S)

    def _check_orphans(self) -> None:
        """Now and then, in a thread of its own: jobs here that lost their batch host
        under --no-kill are requeued (see :mod:`orphans`)."""
        now = self.clock.monotonic()
        if now < self.next_orphan_check or (self.orphan_thread is not None
                                            and self.orphan_thread.is_alive()):
            return
        self.next_orphan_check = now + orphans.CHECK_EVERY_S
        with self.lock:
            views = list(self.jobs.values())
        if not orphans.quiet_jobs(views, self.node):
            return
        self.orphan_thread = threading.Thread(
            target=self._safely, args=(orphans.check, self.cfg, self.adapter, self.node, views,
                                       self.node_loss.before_requeue),
            name="hang-orphans", daemon=True)
        self.orphan_thread.start()

    def watch(self, rec: jobrecord.JobRecord) -> JobView:
        """Read and judge one job's slots; start an incident when a rank is hung."""
        hb = self.cfg.heartbeat
        slots, errors = read_slots(self.cfg.node.run_dir, self.node, rec)
        for err in errors:
            self.slot_log.log(f"job {rec.job_id}", "heartbeat: slots: refused heartbeat slot",
                              job_id=rec.job_id, error=user_text(err))
        alive = {v.rank: evidence.same_process(v.pid, v.pid_start, rec.uid) for v in slots}
        tuned = self.tuned.get(rec.job_id) if hb.auto_tune else None
        verdict = detect.judge(rec.job_id, slots, self.clock.monotonic(), hb, alive=alive,
                               tuned=tuned)
        if verdict.tuned_timeout_s is not None and verdict.tuned_timeout_s != tuned:
            try:
                self.tuned.save(rec.job_id, verdict.tuned_timeout_s)
            except OSError as exc:
                log.warning("heartbeat: tune: couldn't save tuned timeout", job_id=rec.job_id,
                            error=str(exc))
        view = JobView(rec, slots, verdict, errors, self.clock.monotonic())
        with self.lock:
            previous = self.jobs.get(rec.job_id)
            self.jobs[rec.job_id] = view
        if previous is not None and verdict.mode != "off":
            running = {r.rank for r in previous.verdict.ranks if r.state in ("ok", "hung")}
            died = [r.rank for r in verdict.ranks if r.state == "dead" and r.rank in running]
            if died:  # what killed them may be the node's (an Xid): its gate runs now
                self.death_check.rank_died(rec.job_id, died)
        changed = previous is None or previous.verdict.stragglers != verdict.stragglers
        if changed and verdict.stragglers:
            self.straggler_log.log(f"job {rec.job_id}", "straggler ranks", job_id=rec.job_id,
                                   ranks=list(verdict.stragglers)[:64])
        if verdict.mode != "off" and verdict.hung:
            self.start_incident(view, trigger="timeout")
        return view

    def start_incident(self, view: JobView, trigger: str, run: int | None = None,
                       remote: bool = False) -> bool:
        """One incident thread per (job, run), and at most one per job at a time."""
        job_id = view.record.job_id
        if run is None:
            run = max((v.restart_count for v in view.slots), default=0)
        with self.lock:
            busy = job_id in self.threads and self.threads[job_id].is_alive()
            if busy or not self.store.remember((job_id, run)):
                return False
        self.suspects.incident_seen(max(1, len(view.record.nodes)))
        self._spawn(job_id, self._incident, view, trigger, run if remote else None)
        return True

    def _spawn(self, key: int, target: Callable[..., Any], *args: Any) -> None:
        thread = threading.Thread(target=self._safely, args=(target, *args),
                                  name=f"hang-{key}", daemon=True)
        with self.lock:
            self.threads[key] = thread
        thread.start()

    @staticmethod
    def _safely(target: Callable[..., Any], *args: Any) -> None:
        try:
            target(*args)
        except Exception:
            log.exception("hang incident handling failed")

    def _incident(self, view: JobView, trigger: str, run: int | None) -> None:
        report = self.runner.run(view, trigger, run)
        if report is None:
            return
        # The run Slurm says it was: a user's slot cannot make the same run look new.
        with self.lock:
            self.store.remember((report.job_id, report.run))

    # -- cleanup ---------------------------------------------------------------------------------

    def cleanup(self, older_than: float) -> int:
        """Forget incident markers, tuned timeouts and rendezvous pieces older than
        ``older_than`` (wall time)."""
        removed = self.rdv.cleanup(older_than) + self.store.cleanup(older_than)
        try:
            names = os.listdir(self.state_dir)
        except FileNotFoundError:
            return removed
        for name in names:
            path = os.path.join(self.state_dir, name)
            try:
                st = os.lstat(path)
                if name.startswith("tune-") and st.st_mtime < older_than:
                    os.unlink(path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    # -- socket requests -------------------------------------------------------------------------

    def snapshot(self) -> WatcherSnapshot:
        with self.lock:
            return WatcherSnapshot(
                MappingProxyType(dict(self.jobs)),
                tuple(sorted(k for k, t in self.threads.items() if k >= 0 and t.is_alive())))

    def handle_status(self, request: Request, peer: Peer) -> Response:
        """Jobs watched on this node: root sees all, a user only their own."""
        with self.lock:
            views = list(self.jobs.values())
        return socketapi.status(views, self.node, self.cfg.heartbeat.mode, peer,
                               self.suspects.last)

    def handle_report(self, request: Request, peer: Peer) -> Response:
        """A job's own process reports a stall it detected itself: handled like a timeout."""
        with self.lock:
            jobs = dict(self.jobs)
        view = socketapi.owned(jobs, self.node, request, peer)
        started = self.start_incident(view, trigger=f"reported by uid {peer.uid} pid {peer.pid}")
        return {"ok": True, "job_id": view.record.job_id, "started": started}

    def handle_fetch(self, request: Request, peer: Peer) -> Response:
        """The reports of a job, for its owner or root."""
        return socketapi.fetch(self.incident_dir, self.node, request, peer,
                              self.cfg.heartbeat.max_report_bytes)

    def handle_launch_register(self, request: Request, peer: Peer) -> Response:
        """A job's launcher (slurm-resilience launch) says which nodes its step runs on and
        which spares it holds; only for the caller's own job watched on this node."""
        job_id = socketapi.job_id_of(request.get("job_id"))
        with self.lock:
            view = self.jobs.get(job_id)
        return self.launches.register(request, peer,
                                      view.record.uid if view is not None else None)

    def handle_launch_poll(self, request: Request, peer: Peer) -> Response:
        """The relaunch order for the caller's job, if an incident decided one, or a node
        loss found while the step still runs: when the job's ranks here have all ended and
        one died, the step's nodes are probed (see NodeLossDesk.ranks_died)."""
        answer = self.launches.poll(request, peer)
        if answer.get("order") is None:
            job_id = int_arg(request, "job_id")
            with self.lock:
                view = self.jobs.get(job_id)
            if view is not None and view.verdict.ranks_died:
                self.node_loss.ranks_died(job_id)
                answer = self.launches.poll(request, peer)
        return answer

    def handle_launch_step_ended(self, request: Request, peer: Peer) -> Response:
        """The caller's launcher's step ended non-zero without an order: was a node of it
        lost (a relaunch on a spare or a requeue away from it), or wait, or end?"""
        return self.node_loss.step_ended(request, peer)

    def handlers(self) -> dict[str, Handler]:
        return {"hang.status": self.handle_status, "hang.report": self.handle_report,
                "hang.fetch": self.handle_fetch, "launch.register": self.handle_launch_register,
                "launch.poll": self.handle_launch_poll,
                "launch.step_ended": self.handle_launch_step_ended}

    def wait(self, timeout: float = 60.0) -> None:
        """Wait until the incidents and the verification running now have ended."""
        deadline = time.monotonic() + timeout
        with self.lock:
            threads = list(self.threads.values())
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.suspects.close(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop: Slurm retry waits end at once, running work gets CLOSE_GRACE_S to finish.
        Nothing is lost by leaving sooner: claimed plans are persisted step by step and a
        requeue is never repeated (see store and actions), so the next start resumes."""
        self.stopping.set()
        self._close_side_exchange()
        self.wait(CLOSE_GRACE_S)


def factory(ctx: AgentContext) -> HangWatcher | None:
    """The agent's ``heartbeat`` service (mode off only idles, so a reload can turn it on)."""
    return HangWatcher(ctx.cfg, ctx.node, ctx.adapter)

