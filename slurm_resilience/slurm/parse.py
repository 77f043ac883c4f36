"""Pure parsers for ``scontrol show … -o`` and ``squeue --json`` output."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import hostlist

# A key starts a new field only after a space and when it looks like Slurm's CamelCase keys.
_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_]*(?:/[A-Za-z0-9_]+)?)=")
# Slurm appends "[user@time]" to a node reason.
_REASON_TAIL = re.compile(r"\s*\[([^\]@\s]+)@([^\]\s]+)\]\s*$")
# Fields whose values may contain spaces and are printed last-ish: parsed greedily.
_FREE_TEXT_NODE = ("Reason", "Comment", "Extra")


def split_oneliner(line: str, free_text: tuple[str, ...] = ()) -> dict[str, str]:
    """Split one ``scontrol show … -o`` record into its ``Key=value`` fields.

    Values may contain spaces (JobName, Command, Reason); a new field begins
    only at `` CamelKey=``. Keys in ``free_text`` swallow everything up to the
    next key that is not itself inside free text.
    """
    line = line.rstrip("\n")
    matches = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    i = 0
    while i < len(matches):
        m = matches[i]
        key = m.group(1)
        j = i + 1
        if key in free_text:
            # Free text runs to the end unless a known following key appears; Slurm
            # prints Reason near the end, so greedily take up to the last free key.
            later = [k for k in range(j, len(matches)) if matches[k].group(1) in free_text]
            j = len(matches) if not later else later[0]
        end = matches[j].start() if j < len(matches) else len(line)
        out.setdefault(key, line[m.end():end].strip())
        i = j
    return out


def _none(value: str | None) -> str:
    return "" if value in (None, "(null)", "None", "N/A", "n/a") else str(value)


def expand_hostlist(expr: str) -> list[str]:
    """``node[1-3]`` → ``["node1", "node2", "node3"]``; empty or (null) → []."""
    expr = _none(expr)
    return list(hostlist.expand_hostlist(expr)) if expr else []


def collect_hostlist(names: list[str]) -> str:
    """The compact form of a node list."""
    return str(hostlist.collect_hostlist(names)) if names else ""


@dataclass(frozen=True)
class NodeInfo:
    """One node as Slurm reports it."""

    name: str
    state: str
    flags: frozenset[str]
    reason: str = ""
    reason_user: str = ""
    reason_time: str = ""
    features: tuple[str, ...] = ()
    active_features: tuple[str, ...] = ()
    gres: str = ""
    partitions: tuple[str, ...] = ()
    cpus: int = 0
    alloc_cpus: int = 0
    raw: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        return self.state == "DOWN" or "NOT_RESPONDING" in self.flags

    @property
    def idle(self) -> bool:
        return self.state == "IDLE" and self.alloc_cpus == 0


def _csv(value: str) -> tuple[str, ...]:
    value = _none(value)
    return tuple(v for v in value.split(",") if v) if value else ()


def parse_node(line: str) -> NodeInfo:
    """Parse one line of ``scontrol show node NAME -o``."""
    f = split_oneliner(line, _FREE_TEXT_NODE)
    if "NodeName" not in f:
        raise ValueError(f"not a node record: {line[:80]!r}")
    state_parts = _none(f.get("State", "")).split("+")
    reason = _none(f.get("Reason", ""))
    user = when = ""
    tail = _REASON_TAIL.search(reason)
    if tail:
        user, when = tail.group(1), tail.group(2)
        reason = reason[: tail.start()].rstrip()
    return NodeInfo(
        name=f["NodeName"],
        state=state_parts[0].rstrip("*~#!%$@^-"),
        flags=frozenset(p for p in state_parts[1:] if p),
        reason=reason,
        reason_user=user,
        reason_time=when,
        features=_csv(f.get("AvailableFeatures", "")),
        active_features=_csv(f.get("ActiveFeatures", "")),
        gres=_none(f.get("Gres", "")),
        partitions=_csv(f.get("Partitions", "")),
        cpus=int(f.get("CPUTot", "0") or 0),
        alloc_cpus=int(f.get("CPUAlloc", "0") or 0),
        raw=f,
    )


@dataclass(frozen=True)
class JobInfo:
    """One job as Slurm reports it."""

    job_id: int
    name: str
    user: str
    uid: int
    state: str
    reason: str = ""
    nodes: tuple[str, ...] = ()
    batch_host: str = ""
    restarts: int = 0
    requeue: bool = False
    comment: str = ""
    admin_comment: str = ""
    partition: str = ""
    exc_nodes: tuple[str, ...] = ()
    work_dir: str = ""
    std_out: str = ""
    num_nodes: int = 0
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)


_USER_ID = re.compile(r"^(?P<name>[^()]*)\((?P<uid>\d+)\)$")


def parse_job(line: str) -> JobInfo:
    """Parse one line of ``scontrol show job ID -o``."""
    f = split_oneliner(line)
    if "JobId" not in f:
        raise ValueError(f"not a job record: {line[:80]!r}")
    m = _USER_ID.match(f.get("UserId", ""))
    num = _none(f.get("NumNodes", "0")).split("-")[0]
    return JobInfo(
        job_id=int(f["JobId"]),
        name=f.get("JobName", ""),
        user=m.group("name") if m else "",
        uid=int(m.group("uid")) if m else -1,
        state=f.get("JobState", ""),
        reason=_none(f.get("Reason", "")),
        nodes=tuple(expand_hostlist(f.get("NodeList", ""))),
        batch_host=_none(f.get("BatchHost", "")),
        restarts=int(f.get("Restarts", "0") or 0),
        requeue=f.get("Requeue", "0") == "1",
        comment=_none(f.get("Comment", "")),
        admin_comment=_none(f.get("AdminComment", "")),
        partition=_none(f.get("Partition", "")),
        exc_nodes=tuple(expand_hostlist(f.get("ExcNodeList", ""))),
        work_dir=_none(f.get("WorkDir", "")),
        std_out=_none(f.get("StdOut", "")),
        num_nodes=int(num) if num.isdigit() else 0,
        raw=f,
    )


def _flatten_state(value: Any) -> str:
    if isinstance(value, list):
        return str(value[0]) if value else ""
    return str(value or "")


def parse_squeue_json(text: str) -> list[JobInfo]:
    """Parse ``squeue --json`` (data_parser v0.0.38 in 22.05, later versions tolerated)."""
    doc = json.loads(text)
    jobs = []
    for j in doc.get("jobs", []):
        restarts = j.get("restart_cnt", 0)
        num = j.get("node_count", 0)
        if isinstance(num, dict):  # v0.0.39+: {"set": true, "number": 2}
            num = num.get("number", 0)
        jobs.append(
            JobInfo(
                job_id=int(j["job_id"]),
                name=str(j.get("name", "")),
                user=str(j.get("user_name", "")),
                uid=int(j.get("user_id", -1)),
                state=_flatten_state(j.get("job_state")),
                reason=_none(j.get("state_reason", "")),
                nodes=tuple(expand_hostlist(str(j.get("nodes", "") or ""))),
                batch_host=_none(j.get("batch_host", "")),
                restarts=int(restarts or 0),
                requeue=bool(j.get("requeue", False)),
                comment=_none(j.get("comment", "")),
                admin_comment=_none(j.get("admin_comment", "")),
                partition=_none(j.get("partition", "")),
                exc_nodes=tuple(expand_hostlist(str(j.get("excluded_nodes", "") or ""))),
                work_dir=_none(j.get("current_working_directory", "")),
                std_out=_none(j.get("standard_output", "")),
                num_nodes=int(num or 0),
                raw=j,
            )
        )
    return jobs


@dataclass(frozen=True)
class JobRun:
    """One run (allocation) of a job as Slurm accounting recorded it."""

    state: str
    start: float | None  # Unix time; None while unknown
    end: float | None


def _sacct_time(text: str) -> float | None:
    import time

    text = text.strip()
    if not text or text in ("Unknown", "None"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_sacct_runs(text: str) -> list[JobRun]:
    """``sacct -X -n -P --duplicates -o JobID,State,Start,End`` lines, oldest run first."""
    runs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        state = parts[1].split()[0] if parts[1].strip() else ""
        runs.append(JobRun(state, _sacct_time(parts[2]), _sacct_time(parts[3])))
    return runs
