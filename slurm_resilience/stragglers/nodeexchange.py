"""Straggler nodes between a job's agents: summaries up the fan-in tree to the job's judge,
verdicts back to the nodes it names (the decisions are :mod:`.nodes`, pure).

Transport: the agents' munge-authenticated exchange
(:class:`~slurm_resilience.hang.netrendezvous.NetworkRendezvous`, its listener caps, uid and
binding checks), with two message kinds of its own: ``steps`` (summaries, child to parent,
once per ``stragglers.node_interval_s``; an unreachable parent is skipped for the next
ancestor) and ``named`` (judge to named node). A message is accepted only for a job running
on this node, with the node list and judge this node's own job record gives, from a sender
below this node in that job's tree, with summaries of the sender's subtree only; what is
kept is bounded by the jobs here and their node lists.

Per interval, each agent sends one message per job (its own summary and its subtree's
latest), so no agent receives more than ``fanout`` per job and interval, whatever the job's
size. Sends run on threads of their own, at most one per job at a time: the agent's tick
never waits on the network.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.log import get_logger
from slurm_resilience.stragglers.detect import MIN_MEMBERS
from slurm_resilience.stragglers.nodes import (
    JobJudge,
    NodeSummary,
    PieceError,
    Verdict,
    judge_of,
    max_age_s,
    parse_summary,
    parse_verdict,
)
from slurm_resilience.stragglers.record import Entry, StragglerRecord
from slurm_resilience.transport.tree import Tree
from slurm_resilience.transport.wire import Kind, Message

log = get_logger("stragglers")


@dataclass(frozen=True)
class LocalJob:
    """A job with slots on this node, as the step watch sees it now."""

    job_id: int
    user: str
    nodes: tuple[str, ...]  # from the prolog's job record (SLURM_JOB_NODELIST)
    summary: NodeSummary | None  # None until a rank reported a step time


@dataclass
class _Known:
    job: LocalJob
    tree: Tree


class NodeExchange:
    """This agent's part: summarise, forward, judge where it is the judge, tell and be told."""

    def __init__(self, cfg: Callable[[], StragglerSection], node: str, *,
                 judged: StragglerRecord | None = None, clock: Clock = SystemClock()):
        self.cfg = cfg
        self.node = node
        self.judged = judged
        self.clock = clock  # monotonic: the exchange's interval; wall: the record
        self.transport: Any = None  # NetworkRendezvous (or a test's stand-in)
        self.lock = threading.Lock()
        self.known: dict[int, _Known] = {}
        self.inbox: dict[int, dict[str, NodeSummary]] = {}
        self.judges: dict[int, JobJudge] = {}
        self.told: dict[int, set[str]] = {}
        self.pending: dict[int, Verdict] = {}  # verdicts naming this node, for the tick
        self.sending: dict[tuple[str, int, str], threading.Thread] = {}
        self.skipped_sends = 0
        self.next_at = 0.0

    # -- transport -----------------------------------------------------------------------------

    def attach(self, transport: Any) -> None:
        """Use ``transport`` from now on (the watcher may rebuild it on a reload)."""
        if transport is self.transport:
            return
        self.transport = transport
        if transport is not None:
            transport.on(Kind.STEPS, self._on_steps)
            transport.on(Kind.NAMED, self._on_named)

    def fanout(self) -> int:
        return int(getattr(getattr(self.transport, "cfg", None), "fanout", 16))

    # -- the tick ------------------------------------------------------------------------------

    def tick(self, jobs: Sequence[LocalJob]) -> list[Verdict]:
        """Once per agent tick: forget jobs gone, and once per interval send (or judge).
        Returns the verdicts that named this node since the last tick."""
        cfg = self.cfg()
        fanout = self.fanout()
        with self.lock:
            known = {}
            for job in jobs:
                have = self.known.get(job.job_id)
                if have is not None and have.job.nodes == job.nodes \
                        and have.tree.fanout == fanout:
                    known[job.job_id] = _Known(job, have.tree)
                elif len(job.nodes) >= MIN_MEMBERS and self.node in job.nodes:
                    known[job.job_id] = _Known(job, Tree.of(judge_of(job.nodes), job.nodes,
                                                            fanout))
            self.known = known
            for table in (self.inbox, self.judges, self.told, self.pending):
                for gone in [k for k in table if k not in known]:
                    del table[gone]
            mine = list(self.pending.values())
            self.pending.clear()
        interval = cfg.node_interval_s
        if self.transport is None or not interval:
            return mine
        now_m = self.clock.monotonic()
        if now_m < self.next_at:
            return mine
        self.next_at = now_m + interval
        now = self.clock.time()
        for k in known.values():
            self._interval(cfg, k, now, interval)
        with self.lock:
            mine += self.pending.values()
            self.pending.clear()
        return mine

    def _interval(self, cfg: StragglerSection, k: _Known, now: float, interval: float) -> None:
        job, tree = k.job, k.tree
        age = max_age_s(interval, tree.depth(tree.order[-1]))
        with self.lock:
            below = {n: s for n, s in self.inbox.get(job.job_id, {}).items()
                     if now - s.at <= age}
        if job.summary is not None and job.summary.steps:
            below[self.node] = job.summary
        if tree.root != self.node:
            if below:
                ancestors = []
                up = tree.parent(self.node)
                while up is not None:
                    ancestors.append(up)
                    up = tree.parent(up)
                msg = Message(Kind.STEPS, job.job_id, 0, self.node, ancestors[0], tree.root,
                              job.nodes, {n: s.to_piece() for n, s in sorted(below.items())})
                self._spawn(ancestors[0], job.job_id, "steps", msg, ancestors)
            return
        with self.lock:
            judge = self.judges.get(job.job_id)
            if judge is None or judge.cfg != cfg:
                judge = self.judges[job.job_id] = JobJudge(cfg)
        judge.receive(below.values())
        newly = judge.evaluate(now, age)
        if newly:
            verdicts = [v for v in (judge.verdict(job.job_id, n, self.node)
                                    for n in sorted(newly)) if v is not None]
            log.warning("straggler nodes named", job_id=job.job_id,
                        nodes=[v.node for v in verdicts],
                        slowdown=[round(v.slowdown, 3) for v in verdicts],
                        reference_s=round(verdicts[0].reference_s, 4) if verdicts else None,
                        judged=len(judge.last.medians) if judge.last else 0,
                        evaluations=judge.evaluations)
            for v in verdicts:
                self._record_judged(job, v, now, cfg)
        # Tell every named node not yet told (a failed send is tried again next interval).
        with self.lock:
            untold = sorted(judge.named - self.told.get(job.job_id, set()))
        for n in untold:
            told = judge.verdict(job.job_id, n, self.node)
            if told is None:
                continue
            if n == self.node:
                with self.lock:
                    self.pending[job.job_id] = told
                self._mark_told(job.job_id, n, True)
                continue
            msg = Message(Kind.NAMED, job.job_id, 0, self.node, n, self.node, job.nodes,
                          {n: told.to_piece()})
            self._spawn(n, job.job_id, "named", msg, [n], on_done=self._told_cb(job.job_id, n))

    def _told_cb(self, job_id: int, node: str) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            self._mark_told(job_id, node, ok)
        return done

    def _mark_told(self, job_id: int, node: str, ok: bool) -> None:
        with self.lock:
            if ok and job_id in self.known:
                self.told.setdefault(job_id, set()).add(node)

    def _record_judged(self, job: LocalJob, v: Verdict, now: float,
                       cfg: StragglerSection) -> None:
        if self.judged is None:
            return
        try:
            self.judged.add(Entry(now, job.job_id, (), v.slowdown, job.user, node=v.node), now,
                            cfg.record_window_s)
        except OSError as exc:
            log.warning("stragglers: couldn't update the judge's record",
                        path=self.judged.path, error=str(exc))

    def _spawn(self, target: str, job_id: int, what: str, msg: Message, targets: list[str],
               on_done: Callable[[bool], None] | None = None) -> None:
        key = (what, job_id, target)
        with self.lock:
            busy = self.sending.get(key)
            if busy is not None and busy.is_alive():
                self.skipped_sends += 1
                log.info("stragglers: previous send still in progress; this interval's "
                         "skipped", job_id=job_id, kind=what, node=target)
                return
            self.sending = {k: t for k, t in self.sending.items() if t.is_alive()}
            t = threading.Thread(target=self._send, args=(msg, targets, what, on_done),
                                 name=f"straggler-{what}-{job_id}", daemon=True)
            self.sending[key] = t
        t.start()

    def _send(self, msg: Message, targets: list[str], what: str,
              on_done: Callable[[bool], None] | None) -> None:
        took = self.transport.send(msg, targets) if self.transport is not None else ""
        if not took:
            log.error("stragglers: couldn't deliver", kind=what, job_id=msg.job_id,
                      to=targets[:4])
        if on_done is not None:
            on_done(bool(took))

    # -- receiving (on the exchange's connection threads) --------------------------------------

    def _job_of(self, msg: Message) -> tuple[_Known | None, str]:
        with self.lock:
            k = self.known.get(msg.job_id)
        if k is None:
            return None, f"{msg.kind.value}: job {msg.job_id} has no slots on this node"
        if set(msg.nodes) != set(k.job.nodes) or msg.batch_host != k.tree.root:
            return None, (f"{msg.kind.value}: nodes or judge of job {msg.job_id} differ from "
                          "this node's record of the job")
        return k, ""

    def _on_steps(self, msg: Message) -> str:
        k, why = self._job_of(msg)
        if k is None:
            return why
        up = k.tree.parent(msg.sender)
        while up is not None and up != self.node:
            up = k.tree.parent(up)
        if up is None:
            return f"steps: {msg.sender} is not below {self.node} in job {msg.job_id}'s tree"
        if not msg.pieces.keys() <= k.tree.subtree(msg.sender):
            return f"steps: {msg.sender} sent summaries of nodes outside its subtree"
        try:
            got = [parse_summary(n, p) for n, p in msg.pieces.items()]
        except PieceError as exc:
            return f"steps: malformed summary: {exc}"
        with self.lock:
            box = self.inbox.setdefault(msg.job_id, {})
            for s in got:
                have = box.get(s.node)
                if have is None or s.at > have.at:
                    box[s.node] = s
        return ""

    def _on_named(self, msg: Message) -> str:
        k, why = self._job_of(msg)
        if k is None:
            return why
        if msg.sender != k.tree.root:
            return f"named: {msg.sender} is not job {msg.job_id}'s judge"
        if set(msg.pieces) != {self.node}:
            return "named: a verdict names this node only"
        try:
            v = parse_verdict(msg.job_id, self.node, msg.sender, msg.pieces[self.node])
        except PieceError as exc:
            return f"named: malformed verdict: {exc}"
        with self.lock:
            self.pending[msg.job_id] = v
        return ""

    # -- what the metrics and status show ------------------------------------------------------

    def judged_now(self) -> dict[int, frozenset[str]]:
        """Jobs this node judges, and the nodes named in each now."""
        with self.lock:
            return {j: judge.named for j, judge in self.judges.items()}

    def judged_recent(self) -> list[Entry]:
        if self.judged is None:
            return []
        from slurm_resilience.stragglers.record import recent

        return recent(self.judged.load(), self.clock.time(), self.cfg().record_window_s)
