"""Straggler *nodes*: a node persistently slower than the rest of its job, judged by one
agent per job from every node's summary (pure: records in, judgements out; no I/O).

Each agent summarises each job with slots on its node (:class:`NodeSummary`: the median of
its ranks' recent step times, the steps in its window, its ranks, its latest step) and sends
it up the job's fan-in tree (:mod:`slurm_resilience.transport.tree`) to the job's
*judge*, its first node (:func:`judge_of`: the first of the node list every agent of the
job has from the prolog, so all agents agree without asking Slurm). Inner nodes forward
their subtree's latest summaries once per interval; the judge keeps the latest of each node
(:class:`JobJudge`) and judges them with the rank-level math
(:func:`~.detect.judge_summaries`), with the same persistence rule (:func:`~.detect.advance`,
``persist_evaluations`` consecutive judgements, one per interval in which some node made
progress). A named node is told so, and its own agent records it (:mod:`.nodeexchange`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.stragglers.detect import (
    Judgement,
    Summary,
    advance,
    judge_summaries,
    persisted,
)

# A summary older than this many intervals (plus one per level of the tree) is not judged:
# its node left, its agent stopped, or its parent can't reach the judge.
STALE_INTERVALS = 3


class PieceError(ValueError):
    """A summary or a verdict that is not well-formed."""


@dataclass(frozen=True)
class NodeSummary:
    """One node's view of one job, as it travels (JSON, ~60 bytes)."""

    node: str
    median_s: float  # median of the node's ranks' recent step times
    steps: int  # steps in the node's window (the longest of its ranks' windows)
    ranks: int
    step: int  # the latest step any rank of the job reported here: progress
    at: float  # the node's wall clock when it was made

    def to_piece(self) -> bytes:
        return json.dumps({"m": round(self.median_s, 6), "n": self.steps, "r": self.ranks,
                           "s": self.step, "t": round(self.at, 3)},
                          separators=(",", ":")).encode("ascii")


def _number(body: Mapping[str, object], key: str) -> float:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise PieceError(f"{key} is not a non-negative number")
    return float(v)


def _count(body: Mapping[str, object], key: str) -> int:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
        raise PieceError(f"{key} is not a non-negative integer")
    return v


def _object(data: bytes) -> Mapping[str, object]:
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise PieceError(f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise PieceError("not a JSON object")
    return body


def parse_summary(node: str, data: bytes) -> NodeSummary:
    body = _object(data)
    return NodeSummary(node, _number(body, "m"), _count(body, "n"), _count(body, "r"),
                       _count(body, "s"), _number(body, "t"))


@dataclass(frozen=True)
class Verdict:
    """What the judge tells a node it named (the node's own agent records it)."""

    job_id: int
    node: str
    judge: str
    median_s: float
    reference_s: float  # the job's median (median of the nodes' medians)

    @property
    def slowdown(self) -> float:
        return self.median_s / self.reference_s - 1 if self.reference_s > 0 else 0.0

    def to_piece(self) -> bytes:
        return json.dumps({"m": round(self.median_s, 6), "ref": round(self.reference_s, 6)},
                          separators=(",", ":")).encode("ascii")


def parse_verdict(job_id: int, node: str, judge: str, data: bytes) -> Verdict:
    body = _object(data)
    v = Verdict(job_id, node, judge, _number(body, "m"), _number(body, "ref"))
    if v.reference_s <= 0 or v.median_s <= v.reference_s:
        raise PieceError("a named node's median must be above a positive job median")
    return v


def judge_of(nodes: Sequence[str]) -> str:
    """The job's judging agent: its first node (every agent of the job has the same list)."""
    return nodes[0]


def max_age_s(interval_s: float, depth: int) -> float:
    """How old a summary the judge still uses: a few intervals, plus one per tree level it
    may have waited at."""
    return interval_s * (STALE_INTERVALS + depth)


@dataclass
class JobJudge:
    """The judge's state of one job: the latest summary of each node, and streaks."""

    cfg: StragglerSection
    latest: dict[str, NodeSummary] = field(default_factory=dict)
    streak: dict[str, int] = field(default_factory=dict)
    named: frozenset[str] = frozenset()
    last: Judgement[str] | None = None
    progress: dict[str, int] = field(default_factory=dict)  # node -> step at last judgement
    evaluations: int = 0

    def receive(self, summaries: Iterable[NodeSummary]) -> None:
        """Keep each node's newest summary (older ones, arriving late, are dropped)."""
        for s in summaries:
            have = self.latest.get(s.node)
            if have is None or s.at > have.at:
                self.latest[s.node] = s

    def evaluate(self, now: float, max_age: float) -> frozenset[str] | None:
        """Judge the fresh summaries and advance the streaks; returns the nodes newly named,
        or None when no node made progress since the last judgement (a stuck job's stale
        windows are not judged again and again)."""
        fresh = {n: s for n, s in self.latest.items() if now - s.at <= max_age}
        for n in [n for n in self.latest if n not in fresh]:
            del self.latest[n]
        moved = any(s.step > self.progress.get(n, -1) for n, s in fresh.items())
        if not moved:
            return None
        self.progress = {n: s.step for n, s in fresh.items()}
        j = judge_summaries({n: Summary(s.median_s, s.steps) for n, s in fresh.items()},
                            self.cfg)
        self.last = j
        self.evaluations += 1
        self.streak = advance(self.streak, j.slow)
        named = persisted(self.streak, self.cfg)
        newly = named - self.named
        self.named = named
        return newly

    def verdict(self, job_id: int, node: str, judge: str) -> Verdict | None:
        j = self.last
        if j is None or node not in j.medians:
            return None
        return Verdict(job_id, node, judge, j.medians[node], j.reference_s)
