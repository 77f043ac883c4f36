"""The agent's ``metrics`` service: serves ``/metrics`` over HTTP, rewrites the optional
node_exporter textfile, and feeds the straggler step watch from the hang watcher's views.

It is the last service the agent starts, so it finds the others in
``AgentContext.extra["services"]``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from slurm_resilience import events
from slurm_resilience.agent.service import AgentContext, Handler, Peer, Request, Response
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.hang import policy
from slurm_resilience.hang.actions import record_takeout
from slurm_resilience.hang.takeouts import user_key
from slurm_resilience.log import get_logger
from slurm_resilience.metrics import http
from slurm_resilience.metrics.collector import AgentCollector, AgentSources, nccl_path
from slurm_resilience.metrics.saves import SaveBook
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.nodeexchange import NodeExchange
from slurm_resilience.stragglers.record import (
    FILENAME,
    JUDGED_FILENAME,
    Entry,
    StragglerRecord,
    suspicion,
)

log = get_logger("metrics")

LEDGER_RETENTION_S = 14 * 86400.0
LEDGER_CLEANUP_EVERY_S = 3600.0


def write_textfile(path: str, registry: CollectorRegistry) -> None:
    """Replace ``path`` atomically (node_exporter must never read half a file)."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(generate_latest(registry))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class MetricsService:
    name = "metrics"

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter,
                 services: dict[str, Any], agent: Any = None, *, serve: bool = True,
                 wall: Callable[[], float] = time.time):
        self.cfg = cfg
        self.wall = wall
        self.node = node
        self.adapter = adapter
        self.watcher = services.get("heartbeat")
        self.interval_s = min(cfg.heartbeat.interval_s, cfg.metrics.textfile_interval_s)
        self.steps = StepWatch(lambda: self.live_cfg.stragglers, node,
                               StragglerRecord(os.path.join(node_path(cfg.node.state_dir, node),
                                                            FILENAME)),
                               wall, self._on_named)
        state = node_path(cfg.node.state_dir, node)
        # Straggler nodes: this node's summaries to each job's judge, and judging where
        # this node is a job's first node (over the agents' exchange, see tick()).
        self.nodes = NodeExchange(lambda: self.live_cfg.stragglers, node,
                                  judged=StragglerRecord(os.path.join(state, JUDGED_FILENAME)),
                                  wall=wall)
        incidents = node_path(cfg.heartbeat.incident_dir, node) if cfg.heartbeat.incident_dir \
            else os.path.join(state, "incidents")
        self.ledger = Ledger(os.path.join(state, "goodput"), incidents)
        self.saves = SaveBook()
        self.next_cleanup = 0.0
        self.sources = AgentSources(
            node=node, events_path=adapter.events_path or events.path_for(cfg.node.state_dir,
                                                                          node),
            nccl_path=nccl_path(cfg.node.state_dir, node), watcher=self.watcher,
            uploader=services.get("checkpoint"), steps=self.steps, nodes=self.nodes,
            ledger=self.ledger,
            saves=self.saves,
            agent=agent,
            services=tuple(sorted([*services, self.name])))
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = AgentCollector(self.sources)
        self.registry.register(self.collector)
        self.textfile = node_path(cfg.metrics.textfile, node) if cfg.metrics.textfile else ""
        self.next_textfile = 0.0
        self.server: Any = None
        self.url = ""
        m = cfg.metrics
        self.serve_error = ""
        port = m.port_of(node)
        if serve and port:
            host = f"[{m.listen_address}]" if ":" in m.listen_address else m.listen_address
            try:
                self.server = http.serve(m.listen_address, port, self.registry,
                                         wrap=self._queries)
                self.url = f"http://{host}:{port}/metrics"
                log.info("metrics: serving", url=self.url)
            except OSError as exc:
                # Hang watching and uploads go on; the operator sees why metrics don't.
                self.serve_error = f"couldn't listen on {host}:{port}: {exc}"
                log.error("metrics: no HTTP endpoint", error=self.serve_error)
        self._suspecting: threading.Thread | None = None
        self._nodes_on: bool | None = None

    def _queries(self, metrics_app: Any) -> Any:
        """The endpoint also answers a login node's questions about a job (queries)."""
        from slurm_resilience.metrics import answers
        from slurm_resilience.queries.server import QueryApp
        from slurm_resilience.transport.credentials import for_queries

        return QueryApp(self.node, for_queries(self.cfg.heartbeat.exchange),
                        answers.handlers(self.cfg, self.node), metrics_app)

    @property
    def live_cfg(self) -> Config:
        return self.watcher.cfg if self.watcher is not None else self.cfg

    def attach(self, agent: Any) -> None:
        """The agent, once built: its socket server's stats and tick failures."""
        self.sources.agent = agent

    def tick(self) -> None:
        if self.watcher is not None:
            views = list(self.watcher.snapshot().jobs.values())
            self.steps.observe(views)
            self._node_stragglers()
            stalls = {j: (s.run, s.total_stall_s) for j, s in self.saves.snapshot().items()}
            self.ledger.observe(views, time.time(), self._stagein_seconds(), stalls)
        self.saves.keep_only(self._jobs_here())
        now = time.monotonic()
        if now >= self.next_cleanup:
            self.next_cleanup = now + LEDGER_CLEANUP_EVERY_S
            self.ledger.cleanup(time.time() - LEDGER_RETENTION_S)
        if self.textfile and now >= self.next_textfile:
            self.next_textfile = now + self.cfg.metrics.textfile_interval_s
            try:
                write_textfile(self.textfile, self.registry)
            except OSError as exc:
                log.warning("metrics: couldn't write the textfile", path=self.textfile,
                            error=str(exc))

    def _jobs_here(self) -> set[int]:
        jobs: set[int] = set()
        for svc in (self.watcher, self.sources.uploader):
            if svc is not None:
                jobs |= set(svc.snapshot().jobs)
        return jobs

    def _owner(self, job_id: int) -> int | None:
        up = self.sources.uploader
        if up is not None:
            rec = up.snapshot().jobs.get(job_id)
            if rec is not None:
                return int(rec["uid"])
        if self.watcher is not None:
            view = self.watcher.snapshot().jobs.get(job_id)
            if view is not None:
                return int(view.record.uid)
        return None

    def handle_ckpt_saved(self, request: Request, peer: Peer) -> Response:
        """A job's checkpoint save times, from its local leader (the job's owner)."""
        job_id = request.get("job_id")
        owner = self._owner(job_id) if isinstance(job_id, int) else None
        self.saves.report(request, peer, owner)
        return {}

    def _stagein_seconds(self) -> dict[int, float]:
        """Each job's finished stage-in time, from the uploader's records."""
        up = self.sources.uploader
        if up is None:
            return {}
        recs = list(up.snapshot().jobs.values())
        out = {}
        for rec in recs:
            si = rec.get("stagein") or {}
            if si.get("state") in ("done", "failed") and si.get("seconds") is not None:
                out[int(rec["job_id"])] = float(si["seconds"])
        return out

    # -- stragglers --------------------------------------------------------------------------

    def _node_stragglers(self) -> None:
        """Summaries to each job's judge, judging here where this is a job's first node, and
        this node named by a judge recorded like a rank naming (the same suspect path)."""
        exchange = getattr(self.watcher, "exchange", None)
        transport = exchange() if exchange is not None and \
            self.live_cfg.stragglers.node_interval_s else None
        if (transport is not None) is not self._nodes_on:
            self._nodes_on = transport is not None
            if transport is None:
                log.info("stragglers: straggler nodes are not judged (stragglers."
                         "node_interval_s 0, or heartbeat.rendezvous none: no exchange "
                         "between agents); straggler ranks still are")
            else:
                log.info("stragglers: straggler nodes judged over the agents' exchange",
                         interval_s=self.live_cfg.stragglers.node_interval_s)
        self.nodes.attach(transport)
        for verdict in self.nodes.tick(self.steps.local_jobs()):
            self.steps.node_named(verdict)

    def _on_named(self, job_id: int, kept: list[Entry]) -> None:
        node_level = bool(kept) and kept[-1].job_id == job_id and bool(kept[-1].node)
        events.count(self.sources.events_path, events.STRAGGLER,
                     "node_step_time" if node_level else "step_time")
        cfg = self.live_cfg
        need = cfg.stragglers.suspect_after_jobs
        if not need:
            return
        found = suspicion(kept, need)
        if not found:
            fresh = [e for e in kept if not e.suspected]
            if len({e.job_id for e in fresh}) >= need:
                log.warning("stragglers: named in enough jobs, but not of different users: "
                            "not made a suspect", jobs=sorted({e.job_id for e in fresh}),
                            users=sorted({e.user for e in fresh}))
            return
        hb = cfg.heartbeat
        # The suite's observe mode takes the same path, to the adapter, which records the
        # drain it would make instead of making it.
        observing = cfg.mode == "observe"
        if observing:
            self.adapter.observe = True
        if (hb.mode != "act" and not observing) or not hb.drain or not hb.suspect_drain:
            # Nothing would verify it, or the site takes no node out on heuristics.
            log.warning("stragglers: a suspect, reported only (needs heartbeat.mode act, "
                        "heartbeat.drain and heartbeat.suspect_drain)", job_id=job_id,
                        jobs=sorted({e.job_id for e in found}))
            return
        if self._suspecting is not None and self._suspecting.is_alive():
            return
        jobs = sorted({e.job_id for e in found})
        users = {e.user for e in found if e.user}
        # The reason names the job that tipped it, and charges its owner's hang budget.
        user = next((e.user for e in found if e.job_id == job_id and e.user), "") or "-"
        hours = cfg.stragglers.record_window_s / 3600
        what = (f"straggler in {len(jobs)} jobs of {len(users)} users within {hours:g}h "
                f"({','.join(map(str, jobs[-5:]))})")
        self._suspecting = threading.Thread(target=self._suspect, args=(job_id, user, what, jobs),
                                            name="straggler-suspect", daemon=True)
        self._suspecting.start()

    def _suspect(self, job_id: int, user: str, what: str, jobs: list[int]) -> str:
        """Drain as a hang suspect within the hang handling's hourly budgets (counted from
        Slurm's node reasons): the node's own agent verifies it once the jobs left
        (hang.suspect) and returns it to service or keeps it drained. Returns what was
        done. The jobs are counted only once the drain is set, so a failure tries again at
        the next naming and a drain is never repeated for the same jobs."""
        hb = self.live_cfg.heartbeat
        now = self.wall()
        try:
            nodes = self.adapter.list_nodes()
        except SlurmError as exc:
            log.warning("stragglers: couldn't make the node a suspect", error=str(exc))
            return f"couldn't list nodes: {exc}"
        mine = next((n for n in nodes if n.name == self.node), None)
        if mine is None or mine.drained or mine.down:
            why = "unknown to Slurm" if mine is None else f"already out: {mine.reason!r}"
            log.warning("stragglers: a suspect, not drained", node=self.node, why=why)
            return f"not drained: {why}"
        budget = policy.budget_used(nodes, self.adapter.prefix, now)
        room = policy.room(budget.total, budget.by_user.get(user_key(user), 0), hb)
        if room is not policy.Room.OK:
            note = policy.spent_note(budget, user, hb, room, [self.node])
            log.warning("stragglers: a suspect, reported, not taken out of service",
                        node=self.node, note=note)
            events.count(self.sources.events_path, events.BUDGET, "straggler")
            return f"not drained: {note}"
        reason = policy.suspect_reason(job_id, user, now, what)
        try:
            text = self.adapter.drain(self.node, reason)
        except SlurmError as exc:
            log.warning("stragglers: couldn't make the node a suspect", error=str(exc))
            return f"couldn't drain: {exc}"
        try:  # counted against the hourly budgets also after the node is resumed
            recorded = record_takeout(self.adapter, self.node, reason)
        except SlurmError as exc:
            recorded = f"couldn't record the take-out: {exc}"
            log.warning("stragglers: couldn't record the take-out in the node's Comment",
                        error=str(exc))
        try:
            self.steps.record.mark_suspected(jobs)
        except OSError as exc:
            log.warning("stragglers: couldn't mark the jobs counted", path=self.steps.record.path,
                        error=str(exc))
        log.warning("stragglers: node made a suspect for verification", reason=text)
        suspects = getattr(self.watcher, "suspects", None)
        if suspects is not None:
            suspects.incident_seen()  # verify soon, not at the next idle poll
        return f"drained: {text}; {recorded}"

    # -- requests --------------------------------------------------------------------------------

    def handle_stragglers(self, request: Request, peer: Peer) -> Response:
        """This node's straggler record and the jobs with straggler ranks now (anyone may
        ask: no job-private data, only job ids and step times)."""
        return {"node": self.node, "url": self.url, "serve_error": self.serve_error,
                "jobs": [s.__dict__ for s in self.steps.snapshot()],
                "recent": [{"at": e.at, "job_id": e.job_id, "ranks": e.ranks,
                            "slowdown": e.slowdown, "whole_node": bool(e.node)}
                           for e in self.steps.recent_jobs()],
                "judged": [{"at": e.at, "job_id": e.job_id, "node": e.node,
                            "slowdown": e.slowdown} for e in self.nodes.judged_recent()]}

    def handlers(self) -> dict[str, Handler]:
        return {"metrics.stragglers": self.handle_stragglers,
                "metrics.ckpt_saved": self.handle_ckpt_saved}

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def factory(ctx: AgentContext) -> MetricsService:
    return MetricsService(ctx.cfg, ctx.node, ctx.adapter, ctx.extra.get("services", {}),
                          ctx.extra.get("agent"))
