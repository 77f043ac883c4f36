"""What the suite would have done in observe mode, kept per node in one small root-owned
JSON file beside the metrics events file (``observed.json``).

In ``mode: observe`` the adapter records each decision here instead of acting; ``status``
lists them ("would drain node7: SR: health: gpu3 XID 79 ..."), the agent's metrics count
them and ``status --cluster`` gathers them. The same decision repeated (a health check
finding the same Xid every pass) updates its entry's ``last`` and ``times``; the count of
decisions grows only with a new one. Bounded to :data:`MAX_ENTRIES`, newest kept.

Light on purpose: the prolog may import this (json, os, fcntl only).
"""

from __future__ import annotations

import json
import os
import time
from typing import TypedDict

from slurm_resilience import lockedjson
from slurm_resilience.log import get_logger

log = get_logger("slurm")

FILENAME = "observed.json"
MAX_ENTRIES = 50
MAX_BYTES = 1 << 20
MAX_DETAIL = 300


class Decision(TypedDict):
    action: str  # drain | resume | requeue | hold | cancel | release | exclude | comment
    target: str  # a node name or a job id
    detail: str  # the reason it would have set, or what it would have changed
    first: float
    last: float
    times: int


class ObservedDoc(TypedDict):
    decisions: list[Decision]
    counts: dict[str, int]  # action -> distinct decisions so far


def path_beside(events_path: str) -> str:
    return os.path.join(os.path.dirname(events_path), FILENAME) if events_path else ""


def empty() -> ObservedDoc:
    return {"decisions": [], "counts": {}}


def read(path: str) -> ObservedDoc:
    """The decisions; an absent file has none. Raises OSError/ValueError when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return empty()
    with os.fdopen(fd, "rb") as fh:
        data = json.loads(fh.read(MAX_BYTES))
    doc = empty()
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    for d in data.get("decisions", []) if isinstance(data.get("decisions"), list) else []:
        if isinstance(d, dict) and all(isinstance(d.get(k), str)
                                       for k in ("action", "target", "detail")):
            doc["decisions"].append({
                "action": d["action"], "target": d["target"], "detail": d["detail"],
                "first": float(d.get("first") or 0), "last": float(d.get("last") or 0),
                "times": int(d.get("times") or 1)})
    counts = data.get("counts")
    if isinstance(counts, dict):
        doc["counts"] = {str(k): v for k, v in counts.items()
                         if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    return doc


def record(path: str, action: str, target: str, detail: str, now: float | None = None) -> None:
    """Keep one decision that was not carried out; never raises (logs instead)."""
    if not path:
        return
    at = time.time() if now is None else now
    detail = " ".join(detail.split())[:MAX_DETAIL]
    try:
        lockedjson.update(
            path, f".{FILENAME}.lock", read, empty,
            lambda doc: _merge(doc, action, target, detail, at),
            lambda exc: log.warning("observe: decisions file unreadable; starting anew",
                                    path=path, error=str(exc)))
    except OSError as exc:
        log.warning("observe: couldn't record a decision", path=path, action=action,
                    target=target, error=str(exc))


def _merge(doc: ObservedDoc, action: str, target: str, detail: str, at: float) -> None:
    """Pure: the same decision again updates its entry; a new one is appended and counted."""
    for d in doc["decisions"]:
        if (d["action"], d["target"], d["detail"]) == (action, target, detail):
            d["last"] = at
            d["times"] += 1
            return
    doc["decisions"].append({"action": action, "target": target, "detail": detail,
                             "first": at, "last": at, "times": 1})
    doc["decisions"] = doc["decisions"][-MAX_ENTRIES:]
    doc["counts"][action] = doc["counts"].get(action, 0) + 1


def line(d: Decision) -> str:
    """``would drain node7: SR: health: gpu3 XID 79 ...``."""
    return f"would {d['action']} {d['target']}: {d['detail']}"
