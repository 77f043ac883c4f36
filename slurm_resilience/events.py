"""Counters of what the suite did on this node, kept in one small root-owned JSON file.

Drains, returns, requeues and holds happen in different processes (the prolog, the epilog,
the agent's incident threads), so an in-memory counter would lose most of them; each
process adds to the node's file under an exclusive lock instead, and the agent's metrics
read it at scrape time. The file also keeps the last result of each gate check.

Bounded: at most :data:`MAX_KEYS` counters (causes come from our own reason owners and
decision names, not from users, but a bug must not grow the file). Failing to count never
fails the caller: it logs a warning and goes on.

Light on purpose: the prolog imports this (json, os, fcntl only).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import TypedDict

from slurm_resilience import lockedjson
from slurm_resilience.config.paths import node_path
from slurm_resilience.log import get_logger

log = get_logger("metrics")

FILENAME = "metrics-events.json"
MAX_KEYS = 256
MAX_BYTES = 1 << 20
_LABEL = re.compile(r"[^a-z0-9_-]")

# Kinds of counted events; each is one counter family in the metrics.
DRAIN = "drain"
RESUME = "resume"
REQUEUE = "requeue"
HOLD = "hold"
CANCEL = "cancel"
INCIDENT = "incident"
GATE = "gate"  # cause: "<check>:<result>"
STRAGGLER = "straggler"
BUDGET = "budget"  # hang handling kept a blamed node in service: the hourly budget was spent
# A node suspected by several users' jobs got the deeper verification: cleared or failed.
SUSPICION = "suspicion"
CKPT_AGENT = "ckpt_agent_unreachable"  # cause: the hook that found it (prolog, epilog)
PLANNED = "planned"  # a job saved and stopped ahead of its time limit or on preemption
# A launcher's step ended with a node of it lost (launch.nodeloss): what was decided.
NODE_LOSS = "node_loss"
# Buddy copies of checkpoint parts (uploader.buddy_service): transfers by result, and bytes.
BUDDY = "buddy"
BUDDY_BYTES = "buddy_bytes"
KINDS = (DRAIN, RESUME, REQUEUE, HOLD, CANCEL, INCIDENT, GATE, STRAGGLER, BUDGET, SUSPICION,
         CKPT_AGENT, PLANNED, NODE_LOSS, BUDDY, BUDDY_BYTES)

# Every cause each kind can be counted with, so that every series starts at 0 and the first
# event shows in increase(). Kept here, not imported, so the prolog's import stays light; a
# unit test holds them to the owners, decisions and checks they name.
DRAIN_CAUSES = ("health", "nccl", "checkpoint", "heartbeat", "hooks", "hang", "hang_suspect",
                "other")
KNOWN_CAUSES: dict[str, tuple[str, ...]] = {
    DRAIN: DRAIN_CAUSES,
    RESUME: DRAIN_CAUSES,
    # node_fault: the epilog requeued a job a fault of its node killed (health.faultrequeue);
    # time_limit, preempt: planned restarts the training side asked for (ahead of a limit).
    REQUEUE: ("hang", "prolog", "node_fault", "time_limit", "preempt"),
    HOLD: ("hang",),
    CANCEL: ("hang",),
    # hang.incidentrecords.Action values an incident is counted with (skip is a repeat)
    INCIDENT: ("requeue", "relaunch", "hold", "cancel", "leave", "report", "none"),
    STRAGGLER: ("step_time", "node_step_time"),
    BUDGET: ("incident", "straggler"),
    SUSPICION: ("cleared", "failed"),
    # health.gate.CHECKS
    GATE: ("gpu", "xid", "kernel", "infiniband", "nvme", "mounts", "services", "diag", "gdr"),
    CKPT_AGENT: ("prolog", "epilog"),
    PLANNED: ("time_limit", "preempt"),  # hang.limits.CAUSES
    NODE_LOSS: ("relaunch", "requeue", "leave"),  # hang.nodeloss.Verdict's acting values
    # uploader.buddy_service.RESULTS: a copy sent, received (verified), used by a restore,
    # refused by its receiver (or refused here), failed on the way, or uploaded to S3 here
    # for a node no longer in the job (buddy_handoff.py).
    BUDDY: ("sent", "received", "used", "refused", "failed", "uploaded"),
    BUDDY_BYTES: ("sent", "received", "uploaded"),
}


class GateLast(TypedDict):
    result: str  # ok | warn | fail | unknown
    kind: str  # prolog | epilog | healthcheck | manual | idle
    at: float


class OutDoc(TypedDict):
    cause: str
    since: float  # when the node's agent first saw it in our drain


class EventsDoc(TypedDict):
    counters: dict[str, int]  # "<kind>|<cause>" -> count
    gate: dict[str, GateLast]  # check -> its last result
    out: dict[str, OutDoc]  # node -> in a drain of ours since (seen by its own agent)


def path_for(state_dir_template: str, node: str) -> str:
    return os.path.join(node_path(state_dir_template, node), FILENAME)


def label(text: str, limit: int = 40) -> str:
    """A bounded, plain label value (lower case, digits, '_' and '-')."""
    return _LABEL.sub("_", text.lower())[:limit] or "unknown"


def empty() -> EventsDoc:
    return {"counters": {}, "gate": {}, "out": {}}


def read(path: str) -> EventsDoc:
    """The counters; an absent file is all zeros. Raises OSError/ValueError when unreadable
    (the caller says so: a metric that silently reset would lie)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return empty()
    with os.fdopen(fd, "rb") as fh:
        data = json.loads(fh.read(MAX_BYTES))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    doc = empty()
    dropped = 0
    counters = data.get("counters")
    if isinstance(counters, dict):
        doc["counters"] = {str(k): v for k, v in counters.items()
                           if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
        dropped += len(counters) - len(doc["counters"])
    gate = data.get("gate")
    if isinstance(gate, dict):
        for check, last in gate.items():
            at = last.get("at") if isinstance(last, dict) else None
            if not isinstance(last, dict) or not _number(at):
                dropped += 1  # a field of the wrong type is dropped alone, the rest kept
                continue
            doc["gate"][str(check)] = {"result": str(last.get("result", "unknown")),
                                       "kind": str(last.get("kind", "")),
                                       "at": float(at or 0.0)}
    out = data.get("out")
    if isinstance(out, dict):
        for node, o in out.items():
            since = o.get("since") if isinstance(o, dict) else None
            if not isinstance(o, dict) or not _number(since) or since is None:
                dropped += 1
                continue
            doc["out"][str(node)] = {"cause": label(str(o.get("cause", ""))),
                                     "since": float(since)}
    if dropped:
        log.warning("metrics: events file has values of the wrong type; dropped them",
                    path=path, dropped=dropped)
    return doc


def _number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _update(path: str, change: dict[str, int], gate: dict[str, GateLast] | None = None,
            out: tuple[str, OutDoc | None] | None = None) -> None:
    def apply(doc: EventsDoc) -> None:
        for key, n in change.items():
            if key in doc["counters"] or len(doc["counters"]) < MAX_KEYS:
                doc["counters"][key] = doc["counters"].get(key, 0) + n
            else:
                log.warning("metrics: too many counters; not counting", key=key)
        if gate:
            doc["gate"].update(gate)
        if out is not None:
            node, now_out = out
            if now_out is None:
                doc["out"].pop(node, None)
            elif node not in doc["out"]:  # the first sighting stays
                doc["out"][node] = now_out

    lockedjson.update(path, f".{FILENAME}.lock", read, empty, apply,
                      lambda exc: log.warning("metrics: events file unreadable; counting "
                                              "from zero", path=path, error=str(exc)))


def count(path: str, kind: str, cause: str, n: int = 1) -> None:
    """Add ``n`` to the ``kind`` counter with ``cause``; never raises."""
    if not path:
        return
    try:
        _update(path, {f"{kind}|{label(cause)}": n})
    except OSError as exc:
        log.warning("metrics: couldn't count an event", path=path, kind=kind, cause=cause,
                    error=str(exc))


def gate_results(path: str, kind: str, results: dict[str, str], now: float | None = None
                 ) -> None:
    """Record one gate run: each check's result counted and kept as its last result."""
    if not path or not results:
        return
    at = time.time() if now is None else now
    try:
        _update(path, {f"{GATE}|{label(c)}:{label(r)}": 1 for c, r in results.items()},
                {label(c): {"result": label(r), "kind": label(kind), "at": at}
                 for c, r in results.items()})
    except OSError as exc:
        log.warning("metrics: couldn't record gate results", path=path, error=str(exc))


def observe_drain(path: str, node: str, cause: str | None, now: float) -> None:
    """The node's own agent looked at it in Slurm: in a drain of ours with ``cause``, or
    not (None). Keeps since when it is out (the first sighting; reasons we re-set on each
    health-check pass don't move it); writes only on a change; never raises."""
    if not path:
        return
    try:
        known = read(path)["out"].get(node)
        if (known is None) == (cause is None):
            return
        _update(path, {}, out=(node, None if cause is None else
                               {"cause": label(cause), "since": now}))
    except (OSError, ValueError) as exc:
        log.warning("metrics: couldn't record the node's drain", path=path, error=str(exc))
