"""The agent's ``stragglers`` service: feeds the step watch with the hang watcher's job
views, exchanges node summaries with the job's other agents and judges where this node is a
job's first node, and makes this node a hang suspect once it was named in enough jobs.

Other services (metrics) read it only through :meth:`StragglerService.snapshot`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from slurm_resilience import events
from slurm_resilience.agent.service import AgentContext, Handler
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.hang import policy
from slurm_resilience.hang.actions import record_takeout
from slurm_resilience.hang.takeouts import user_key
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.stragglers.jobsteps import JobSteps, StepWatch
from slurm_resilience.stragglers.nodeexchange import NodeExchange
from slurm_resilience.stragglers.nodes import Verdict
from slurm_resilience.stragglers.record import (
    FILENAME,
    JUDGED_FILENAME,
    Entry,
    StragglerRecord,
    suspicion,
)

log = get_logger("stragglers")


@dataclass(frozen=True)
class StragglerSnapshot:
    """What other services (metrics) read of the stragglers, copied when asked."""

    jobs: tuple[JobSteps, ...]  # each job's step times on this node
    named_here: tuple[tuple[int, Verdict], ...]  # jobs whose judge names this node now
    judged_now: Mapping[int, frozenset[str]]  # nodes this node, a judge, names now
    recent: tuple[Entry, ...]  # this node's record within stragglers.record_window_s
    judged_recent: tuple[Entry, ...]  # this node's judgements within that window


def snapshot_of(steps: StepWatch, nodes: NodeExchange | None = None) -> StragglerSnapshot:
    return StragglerSnapshot(
        tuple(steps.snapshot()), tuple(steps.named_here()),
        MappingProxyType(dict(nodes.judged_now()) if nodes is not None else {}),
        tuple(steps.recent_jobs()),
        tuple(nodes.judged_recent()) if nodes is not None else ())


def status_of(snap: StragglerSnapshot) -> dict[str, list[dict[str, Any]]]:
    """The ``metrics.stragglers`` answer's straggler part: no job owners, only job ids and
    step times."""
    return {"jobs": [s.__dict__ for s in snap.jobs],
            "recent": [{"at": e.at, "job_id": e.job_id, "ranks": e.ranks,
                        "slowdown": e.slowdown, "whole_node": bool(e.node)}
                       for e in snap.recent],
            "judged": [{"at": e.at, "job_id": e.job_id, "node": e.node,
                        "slowdown": e.slowdown} for e in snap.judged_recent]}


class StragglerService:
    name = "stragglers"

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter, watcher: Any = None,
                 *, clock: Clock = SystemClock()):
        self.cfg = cfg
        self.clock = clock
        self.node = node
        self.adapter = adapter
        self.watcher = watcher  # hang.watcher.HangWatcher: job views, exchange, suspects
        # As often as the metrics: the step windows sample one step time per tick.
        self.interval_s = min(cfg.heartbeat.interval_s, cfg.metrics.textfile_interval_s)
        self.events_path = adapter.events_path or events.path_for(cfg.node.state_dir, node)
        state = node_path(cfg.node.state_dir, node)
        self.steps = StepWatch(lambda: self.live_cfg.stragglers, node,
                               StragglerRecord(os.path.join(state, FILENAME)), clock,
                               self._on_named)
        # Straggler nodes: this node's summaries to each job's judge, and judging where
        # this node is a job's first node (over the agents' exchange, see tick()).
        self.nodes = NodeExchange(lambda: self.live_cfg.stragglers, node,
                                  judged=StragglerRecord(os.path.join(state, JUDGED_FILENAME)),
                                  clock=clock)
        self._suspecting: threading.Thread | None = None
        self._nodes_on: bool | None = None

    @property
    def live_cfg(self) -> Config:
        return self.watcher.cfg if self.watcher is not None else self.cfg

    def tick(self) -> None:
        if self.watcher is None:
            return
        self.steps.observe(list(self.watcher.snapshot().jobs.values()))
        self._node_stragglers()

    def snapshot(self) -> StragglerSnapshot:
        return snapshot_of(self.steps, self.nodes)

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
        events.count(self.events_path, events.STRAGGLER,
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
        now = self.clock.time()
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
            events.count(self.events_path, events.BUDGET, "straggler")
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

    def handlers(self) -> dict[str, Handler]:
        return {}  # its state is served by the metrics service (metrics.stragglers)

    def close(self) -> None:
        pass


def factory(ctx: AgentContext) -> StragglerService:
    return StragglerService(ctx.cfg, ctx.node, ctx.adapter,
                            ctx.extra.get("services", {}).get("heartbeat"))
