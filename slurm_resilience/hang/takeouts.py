"""Our hang reasons on nodes, and the record of recent take-outs kept in each node's Comment.

The hourly hang budgets count how many nodes hang handling took out of service as suspects
within the hour (drains on evidence are not budgeted). A node's reason says so only while
the node stays out: a suspect that passed verification is resumed and its reason is gone.
So every suspect take-out is also recorded in the node's ``Comment`` (a field Slurm keeps
across resume and that only operators, and root's agents, may set), as one bounded group
``[sr-out USER/JOB/EPOCH ...]`` beside any text an operator keeps there. Agents on
different nodes decide independently; slurmctld is the shared truth they all read through
the adapter. Pure: parsing and merging only.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

# "SR: suspect hang job 12 user alice at 2026-11-23T15:40:00Z: rank 1 stalled first"
_REASON = re.compile(r"^(?:\S+:\s+)?(?P<suspect>suspect )?hang (?:job (?P<job>\d+)|suspect of "
                     r"jobs [^ ]+) user (?P<user>\S+) at (?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")
WINDOW_S = 3600.0
# Entries kept per node: more than any node can be taken out in an hour while the cluster
# budget (at most this many take-outs an hour is sensible) holds.
MAX_ENTRIES = 32
MAX_COMMENT = 1024
_GROUP = re.compile(r"\[sr-out(?P<body>(?: [^\s\[\]]*)*)\]")
_ENTRY = re.compile(r"(?P<user>[A-Za-z0-9._-]{1,64})/(?P<job>\d{1,12})/(?P<at>\d{1,12})")
_USER_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _epoch(text: str) -> float:
    return float(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone)


@dataclass(frozen=True)
class HangReason:
    """What one of our hang reasons on a node says."""

    suspect: bool
    job_id: int | None
    user: str
    at: float


def parse_reason(reason: str) -> HangReason | None:
    m = _REASON.match(reason)
    if not m:
        return None
    job = m.group("job")
    # "hang suspect of jobs ...": an earlier release drained a node for suspicion adding up;
    # it is a suspect like any other now (verified, and returned when it passes).
    return HangReason(bool(m.group("suspect")) or not job, int(job) if job else None,
                      m.group("user"), _epoch(m.group("at")))


def user_key(user: str) -> str:
    """A user name as the record keeps it (the budget counts by this key)."""
    return _USER_UNSAFE.sub("_", user)[:64] or "-"


@dataclass(frozen=True)
class TakeOut:
    """One node taken out of service by hang handling: whose job, when (Unix seconds)."""

    user: str
    job_id: int
    at: int

    @staticmethod
    def of(reason: HangReason) -> TakeOut:
        return TakeOut(user_key(reason.user), reason.job_id or 0, int(reason.at))

    def token(self) -> str:
        return f"{self.user}/{self.job_id}/{self.at}"


def parse_comment(comment: str) -> list[TakeOut]:
    """The take-outs recorded in a node's Comment (malformed entries are skipped)."""
    m = _GROUP.search(comment)
    if not m:
        return []
    out = []
    for token in m.group("body").split():
        e = _ENTRY.fullmatch(token)
        if e:
            out.append(TakeOut(e.group("user"), int(e.group("job")), int(e.group("at"))))
    return out


def merge_comment(comment: str, new: TakeOut) -> str:
    """``comment`` with ``new`` recorded: entries older than the window before ``new`` are
    dropped, at most MAX_ENTRIES newest kept, an operator's own text left after the group
    (trimmed, never ours, when the whole would be too long)."""
    kept = {t for t in parse_comment(comment) if new.at - t.at <= WINDOW_S}
    kept.add(new)
    newest = sorted(kept, key=lambda t: (t.at, t.user, t.job_id))[-MAX_ENTRIES:]
    group = "[sr-out " + " ".join(t.token() for t in newest) + "]"
    other = " ".join(_GROUP.sub(" ", comment).split())
    # One line, printable: the Comment is shown by scontrol and sinfo.
    other = "".join(c if c.isprintable() else " " for c in other)
    return f"{group} {other}"[:MAX_COMMENT].rstrip() if other else group
