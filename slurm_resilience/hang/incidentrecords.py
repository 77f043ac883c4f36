"""Typed records of a hang incident: what one node saw (its piece), what the batch host
decided, and the report that is kept and shown. Nothing here acts or reads files.

A piece travels between agents as JSON (:func:`piece_to_bytes` / :func:`piece_from_bytes`);
the receiving side validates its shape and size, so a malformed piece is refused, not used.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from slurm_resilience.clock import Clock as Clock
from slurm_resilience.clock import SystemClock as SystemClock
from slurm_resilience.hang.blame import RankObservation

MAX_PIECE_BYTES = 64 << 10


class Action(enum.Enum):
    """What the batch host does about a hang of a job."""

    REQUEUE = "requeue"
    RELAUNCH = "relaunch"  # the step relaunched inside the allocation (slurm-resilience launch)
    HOLD = "hold"
    CANCEL = "cancel"
    LEAVE = "leave"  # --no-requeue job left running (policy)
    REPORT = "report"  # observe mode, or another node decides
    SKIP = "skip"  # this run was already handled
    NONE = "none"  # nothing could be decided (Slurm unreachable past the deadline)


class NodeVerdict(enum.Enum):
    """What the incident does to one node."""

    DRAIN = "drain"  # evidence about the node itself
    SUSPECT = "suspect"  # heuristic blame: verify before it takes other work
    SPARE = "spare"  # blamed, but past the budget: reported only


@dataclass(frozen=True)
class RankLine:
    """One rank in the report."""

    rank: int
    node: str
    state: str
    step: int
    idle_s: float
    timeout_s: float
    timeout_kind: str
    section: str
    pid: int
    mean_step_s: float
    max_step_s: float
    last_progress_at: float


class BlameDoc(TypedDict):
    """handling._blame_json: who the batch host blames, and why."""

    nodes: list[str]
    ranks: list[int]
    rule: str
    explanation: str


class NodeCallDoc(TypedDict):
    node: str
    verdict: str  # a NodeVerdict's value
    reason: str


class DecisionDoc(TypedDict, total=False):
    """``action`` and ``reason`` are always there ("none"/"not decided" when undecided)."""

    action: str  # an Action's value
    reason: str
    ledger: str
    ckpt_step: int
    budget: str
    nodes: list[NodeCallDoc]
    exclude: list[str]


class TimingsDoc(TypedDict, total=False):
    evidence_s: float
    hang_started_at: float
    detect_after_s: float
    action_at: float
    action_after_s: float


class ReportDoc(TypedDict, total=False):
    """An incident report as kept in ``hang-job<J>-run<R>-<node>.json``. Reports written by
    every release have job_id, restart, node and mode (incident.read_report checks them)."""

    job_id: int
    restart: int
    user: str
    uid: int
    node: str
    mode: str
    trigger: str
    detected_at: float
    ranks: list[dict[str, Any]]  # RankLine fields
    evidence: dict[str, Any]  # node -> its evidence (evidence.py's documents)
    decision: DecisionDoc
    actions: list[str]
    timings: TimingsDoc
    blame: BlameDoc
    files: list[str]


@dataclass(frozen=True)
class Piece:
    """One node's summary of an incident: its ranks, stalled-rank observations, the node's
    own fresh findings and its evidence (stacks, Xids, health) for the report."""

    node: str
    trigger: str
    at: float
    ranks: tuple[RankLine, ...]
    observations: tuple[RankObservation, ...]
    findings: tuple[str, ...]
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "trigger": self.trigger, "at": self.at,
                "ranks": [asdict(r) for r in self.ranks],
                "observations": [asdict(o) for o in self.observations],
                "findings": list(self.findings), "evidence": dict(self.evidence)}


def piece_to_bytes(piece: Piece) -> bytes:
    """The piece as JSON, evidence trimmed (stacks shortened) to stay under 64 KiB."""
    data = piece.to_json()
    raw = json.dumps(data, default=str).encode()
    if len(raw) <= MAX_PIECE_BYTES:
        return raw
    # Stacks are the bulk; the batch host's report keeps the local copy anyway.
    ev = dict(data["evidence"])
    ev["ranks"] = [{**r, "stack": str(r.get("stack", ""))[-1024:]} for r in ev.get("ranks", [])]
    data["evidence"] = ev
    raw = json.dumps(data, default=str).encode()
    if len(raw) <= MAX_PIECE_BYTES:
        return raw
    data["evidence"] = {"trimmed": f"evidence larger than {MAX_PIECE_BYTES} bytes: kept on "
                                   f"{piece.node}"}
    return json.dumps(data, default=str).encode()[:MAX_PIECE_BYTES]


class PieceError(ValueError):
    """A piece that is not what an agent sends."""


def _f(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PieceError(f"{what} is not a number")
    return float(value)


def _i(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PieceError(f"{what} is not an integer")
    return value


def _s(value: Any, what: str, limit: int = 4096) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise PieceError(f"{what} is not a string of at most {limit} characters")
    return value


def _list(value: Any, what: str, limit: int = 4096) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise PieceError(f"{what} is not a list of at most {limit} items")
    return value


def piece_from_bytes(raw: bytes, sender: str) -> Piece:
    """Validate a received piece; ``sender`` (authenticated by the transport) must be the node
    it speaks for, and observations may only be about that node's ranks."""
    if len(raw) > MAX_PIECE_BYTES:
        raise PieceError(f"piece of {len(raw)} bytes is over {MAX_PIECE_BYTES}")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise PieceError(f"piece is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PieceError("piece is not a JSON object")
    node = _s(data.get("node"), "node", 256)
    if node != sender:
        raise PieceError(f"piece from {sender} speaks for {node}")
    ranks = []
    for r in _list(data.get("ranks"), "ranks"):
        if not isinstance(r, dict):
            raise PieceError("rank is not an object")
        ranks.append(RankLine(
            _i(r.get("rank"), "rank"), node, _s(r.get("state"), "state", 16),
            _i(r.get("step"), "step"), _f(r.get("idle_s"), "idle_s"),
            _f(r.get("timeout_s"), "timeout_s"), _s(r.get("timeout_kind"), "timeout_kind", 256),
            _s(r.get("section", ""), "section", 256), _i(r.get("pid"), "pid"),
            _f(r.get("mean_step_s"), "mean_step_s"), _f(r.get("max_step_s"), "max_step_s"),
            _f(r.get("last_progress_at"), "last_progress_at")))
    obs = []
    for o in _list(data.get("observations"), "observations"):
        if not isinstance(o, dict):
            raise PieceError("observation is not an object")
        coll = o.get("in_collective")
        if coll is not None and not isinstance(coll, bool):
            raise PieceError("in_collective is not a boolean")
        obs.append(RankObservation(_i(o.get("rank"), "rank"), node, _i(o.get("step"), "step"),
                                   _f(o.get("last_progress"), "last_progress"), coll,
                                   _f(o.get("step_time_s", 0.0), "step_time_s")))
    findings = tuple(_s(f, "finding", 512) for f in _list(data.get("findings"), "findings", 64))
    evidence = data.get("evidence", {})
    if not isinstance(evidence, dict):
        raise PieceError("evidence is not an object")
    return Piece(node, _s(data.get("trigger", ""), "trigger", 512),
                 _f(data.get("at"), "at"), tuple(ranks), tuple(obs), findings, evidence)


@dataclass(frozen=True)
class NodeCall:
    """The incident's verdict on one node and the reason Slurm will show."""

    node: str
    verdict: NodeVerdict
    reason: str


@dataclass(frozen=True)
class Decision:
    """Everything the batch host decided, before acting."""

    action: Action
    reason: str
    ledger: str  # the AdminComment token to set
    ckpt_step: int  # root-side committed step (-1: none known)
    nodes: tuple[NodeCall, ...] = ()
    exclude: tuple[str, ...] = ()  # suspects the requeued job avoids
    budget_note: str = ""


@dataclass(frozen=True)
class Timings:
    detected_at: float
    evidence_s: float
    hang_started_at: float | None = None
    action_at: float | None = None

    def to_json(self) -> TimingsDoc:
        out: TimingsDoc = {"evidence_s": round(self.evidence_s, 3)}
        if self.hang_started_at is not None:
            out["hang_started_at"] = self.hang_started_at
            out["detect_after_s"] = round(self.detected_at - self.hang_started_at, 3)
            if self.action_at is not None:
                out["action_at"] = self.action_at
                out["action_after_s"] = round(self.action_at - self.hang_started_at, 3)
        elif self.action_at is not None:
            out["action_at"] = self.action_at
        return out


@dataclass(frozen=True)
class Report:
    """What is kept by the agent and returned by ``slurm-resilience report``."""

    job_id: int
    run: int
    user: str
    uid: int
    node: str
    mode: str
    trigger: str
    ranks: tuple[RankLine, ...]
    evidence: Mapping[str, Any]
    blame: BlameDoc | None
    decision: Decision | None
    actions: tuple[str, ...]
    timings: Timings

    def to_json(self) -> ReportDoc:
        d = self.decision
        decision: DecisionDoc = {"action": "none", "reason": "not decided"}
        if d is not None:
            decision = {"action": d.action.value, "reason": d.reason, "ledger": d.ledger,
                        "ckpt_step": d.ckpt_step, "budget": d.budget_note,
                        "nodes": [{"node": c.node, "verdict": c.verdict.value, "reason": c.reason}
                                  for c in d.nodes], "exclude": list(d.exclude)}
        out: ReportDoc = {
            "job_id": self.job_id, "restart": self.run, "user": self.user, "uid": self.uid,
            "node": self.node, "mode": self.mode, "trigger": self.trigger,
            "detected_at": self.timings.detected_at,
            "ranks": [asdict(r) for r in self.ranks], "evidence": dict(self.evidence),
            "decision": decision, "actions": list(self.actions),
            "timings": self.timings.to_json()}
        if self.blame:  # only the deciding node (the batch host) blames
            out["blame"] = self.blame
        return out


def first_hang(ranks: Sequence[RankLine]) -> float | None:
    """When the earliest hung rank last made progress."""
    return min((r.last_progress_at for r in ranks if r.state == "hung"), default=None)
