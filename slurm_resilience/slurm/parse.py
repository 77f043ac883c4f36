"""Pure parsers for ``scontrol show … -o`` one-line records, and the records they fill.

The JSON forms (``scontrol --json``, ``squeue --json``) are read by
:mod:`slurm_resilience.slurm.parse_json`; the adapter uses this text form only
on Slurm 22.05, whose ``scontrol`` has no ``--json``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import hostlist

# A key starts a new field only after a space and when it looks like Slurm's CamelCase keys,
# which may join parts with "/" (CPUs/Task) or ":" (AllocNode:Sid, ReqB:S:C:T).
_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_]*(?:[/:][A-Za-z0-9_*]+)*)=")
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
    address: str = ""
    hostname: str = ""
    port: int = 0  # its slurmd's port (``Port=``); 0 when Slurm doesn't show one
    # Operators' free text; hang handling keeps its record of recent take-outs in it.
    comment: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

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
        address=_none(f.get("NodeAddr", "")),
        hostname=_none(f.get("NodeHostName", "")),
        port=int(f["Port"]) if f.get("Port", "").isdigit() else 0,
        comment=_none(f.get("Comment", "")),
        raw=f,
    )


# Job states a job never leaves (scontrol's JobState base names).
JOB_FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


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
    # The nodes the job asked for by name (-w/--nodelist).
    req_nodes: tuple[str, ...] = ()
    work_dir: str = ""
    std_out: str = ""
    num_nodes: int = 0
    priority: int = 0
    # The job's --constraint; "" when it has none.
    features: str = ""
    # --switches: the most leaf switches wanted (0: no request) and how long to wait for them.
    switches: int = 0
    switch_wait_s: int = 0
    # Whether the job has its nodes to itself; None where Slurm's output does not say
    # (26.05's JSON reports an --exclusive job like any other).
    exclusive: bool | None = None
    submit_time: int = 0
    start_time: int = 0
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)


_USER_ID = re.compile(r"^(?P<name>[^()]*)\((?P<uid>\d+)\)$")
_SWITCHES = re.compile(r"^(?P<count>\d+)@(?P<wait>[\d:-]+)$")
# Fields a job's owner writes, and the keys Slurm prints right after each: inside such a
# value, text that looks like "Key=" is part of the value unless Key is one of these.
# Between Command and StdErr Slurm prints the submit line (24.11+), the working
# directory and the comments; after StdOut the keys printed only when set (those seen
# here), then Power on 22.05; 24.11+ may end with StdOut.
_IN_COMMAND_BLOCK = {"SubmitLine", "WorkDir", "AdminComment", "SystemComment", "Comment",
                     "StdErr"}
_AFTER_STDOUT = {"Power", "Switches", "TresPerNode", "TresPerJob", "TresPerTask",
                 "TresPerSocket", "CpusPerTres", "MemPerTres", "TresBind", "TresFreq",
                 "NtasksPerTRES", "MailUser", "MailType", "CPU_Freq"}
_AFTER_USER_FIELD = {
    "JobName": {"UserId"},
    "Network": {"Command"},
    "Command": _IN_COMMAND_BLOCK,
    "SubmitLine": _IN_COMMAND_BLOCK,
    "WorkDir": _IN_COMMAND_BLOCK,
    "Comment": _IN_COMMAND_BLOCK,
    "StdErr": {"StdIn"},
    "StdIn": {"StdOut"},
    "StdOut": _AFTER_STDOUT,
}

# Keys Slurm prints in every job record, once: inside a user-written value they can only
# be forged (a fake field earlier in the record swallowing the real ones).
_EVERY_JOB_RECORD = {"JobId", "JobName", "UserId", "GroupId", "Priority", "JobState",
                     "Reason", "Requeue", "Restarts", "Partition", "NodeList", "NumNodes",
                     "Command", "WorkDir", "StdErr", "StdIn", "StdOut"}


class AmbiguousRecord(ValueError):
    """A text record in which a user-written value could pass for another field."""


def split_job_record(line: str) -> dict[str, str]:
    """Split a ``scontrol show job -o`` record, keeping "Key=" text inside user-written
    values (job name, command, submit line, comment, paths) where Slurm would not print
    that key next. Raises :class:`AmbiguousRecord` when a key still comes out twice, or
    a key of every record ends up inside a value: the user wrote text that reads as the
    fields that follow, and the text form cannot say which are Slurm's."""
    line = line.rstrip("\n")
    starts: list[re.Match[str]] = []
    for m in _KEY.finditer(line):
        current = starts[-1].group(1) if starts else ""
        allowed = _AFTER_USER_FIELD.get(current)
        if allowed is None or m.group(1) in allowed:
            starts.append(m)
        elif m.group(1) in _EVERY_JOB_RECORD:
            raise AmbiguousRecord(f"job record has {m.group(1)}= inside {current} (a forged "
                                  f"field before it?): {line[:80]!r}")
    keys = [m.group(1) for m in starts]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise AmbiguousRecord(f"job record has {', '.join(twice)} more than once (text in a "
                              f"field the user writes?): {line[:80]!r}")
    return {m.group(1): line[m.end():starts[i + 1].start() if i + 1 < len(starts)
                              else len(line)].strip()
            for i, m in enumerate(starts)}


def _switches(value: str) -> tuple[int, int]:
    """``2@00:00:30`` → (2, 30); absent or unset → (0, 0)."""
    m = _SWITCHES.match(_none(value))
    if not m:
        return 0, 0
    seconds = 0
    days, _, clock = m.group("wait").rpartition("-")
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return int(m.group("count")), seconds + int(days or 0) * 86400


def _text_time(value: str) -> int:
    value = _none(value)
    if not value or value in ("Unknown", "None"):
        return 0
    return int(time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S")))


def parse_job(line: str) -> JobInfo:
    """Parse one line of ``scontrol show job ID -o``.

    Raises :class:`AmbiguousRecord` when a value the job's owner wrote holds text that
    could pass for another field (``sbatch --comment "StdErr=/x"``): the text form cannot
    say which is real, so it is refused rather than guessed (see :func:`split_job_record`)."""
    f = split_job_record(line)
    if "JobId" not in f:
        raise ValueError(f"not a job record: {line[:80]!r}")
    m = _USER_ID.match(f.get("UserId", ""))
    num = _none(f.get("NumNodes", "0")).split("-")[0]
    switches, switch_wait = _switches(f.get("Switches", ""))
    oversubscribe = _none(f.get("OverSubscribe", ""))
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
        req_nodes=tuple(expand_hostlist(f.get("ReqNodeList", ""))),
        work_dir=_none(f.get("WorkDir", "")),
        std_out=_none(f.get("StdOut", "")),
        num_nodes=int(num) if num.isdigit() else 0,
        priority=int(f.get("Priority", "0") or 0),
        features=_none(f.get("Features", "")),
        switches=switches,
        switch_wait_s=switch_wait,
        # 22.05 prints OverSubscribe=NO for --exclusive; 26.05 prints Exclusive=NODE.
        exclusive=(f.get("Exclusive", "NO") not in ("NO", "")) if "Exclusive" in f
        else (oversubscribe == "NO" if oversubscribe else None),
        submit_time=_text_time(f.get("SubmitTime", "")),
        start_time=_text_time(f.get("StartTime", "")),
        raw=f,
    )


@dataclass(frozen=True)
class JobRun:
    """One run (allocation) of a job as Slurm accounting recorded it."""

    state: str
    start: float | None  # Unix time; None while unknown
    end: float | None
    nodes: tuple[str, ...] = ()  # the run's allocation; () where sacct gave none


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
    """``sacct -X -n -P --duplicates -o JobID,State,Start,End[,NodeList]`` lines, oldest run
    first. NodeList is "None assigned" for a run that never started."""
    runs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        state = parts[1].split()[0] if parts[1].strip() else ""
        nodes = parts[4].strip() if len(parts) > 4 else ""
        runs.append(JobRun(state, _sacct_time(parts[2]), _sacct_time(parts[3]),
                           tuple(expand_hostlist(nodes)) if nodes and " " not in nodes
                           else ()))
    return runs


_CONFIG_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)\s+=\s?(.*)$")


def parse_show_config(text: str) -> dict[str, str]:
    """``scontrol show config`` → {key: value}; Slurm's "(null)" reads as ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _CONFIG_LINE.match(line.strip())
        if m:
            value = m.group(2).strip()
            out[m.group(1)] = "" if value in ("(null)", "None") else value
    return out


_PREEMPT_MODE = re.compile(r"(?:^|\s)PreemptMode=(\S+)")


def parse_partition_preempt_mode(text: str) -> str:
    """``scontrol show partition NAME -o`` → its PreemptMode, upper case (``CANCEL``,
    ``REQUEUE``, ``GANG,SUSPEND``...). Slurm prints the cluster's mode for a partition that
    sets none. Raises ValueError when the record has none (not a partition record)."""
    m = _PREEMPT_MODE.search(text)
    if not m:
        raise ValueError(f"no PreemptMode in the partition record: {text[:80]!r}")
    return m.group(1).upper()
