"""This node's persistent straggler record: the jobs it was named a straggler in.

One small root-owned JSON file, replaced atomically, bounded to :data:`MAX_ENTRIES`
entries and to the configured window. It survives agent restarts, so a node that is slow
again and again, in job after job, shows as recurring (``status``, the metrics) and can be
made a suspect.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace

from slurm_resilience.log import get_logger

log = get_logger("stragglers")

FILENAME = "stragglers.json"
# A judging agent's record of the nodes it named in the jobs it judged (node field set).
JUDGED_FILENAME = "stragglers-judged.json"
MAX_ENTRIES = 256
MAX_BYTES = 1 << 20
MIN_USERS = 2


@dataclass(frozen=True)
class Entry:
    at: float  # Unix time it was named
    job_id: int
    ranks: tuple[int, ...]
    slowdown: float  # its median over the job's, minus one (0.2: 20% slower)
    user: str = ""  # the job's owner ("": unknown, e.g. a record from an older version)
    # Already counted towards a suspect drain of this node: never counted again.
    suspected: bool = False
    # A node named as a whole against the job's other nodes (by the job's judging agent):
    # this node in its own record, the named node in a judge's record; "" for ranks.
    node: str = ""


class StragglerRecord:
    def __init__(self, path: str):
        self.path = path
        # The agent's tick adds, the suspect drain's thread marks: one writer at a time.
        self.lock = threading.Lock()

    def load(self) -> list[Entry]:
        """The entries; an unreadable file is reported and read as empty."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            with os.fdopen(fd, "rb") as fh:
                raw = json.loads(fh.read(MAX_BYTES))
            return [Entry(float(e["at"]), int(e["job_id"]), tuple(int(r) for r in e["ranks"]),
                          float(e["slowdown"]), str(e.get("user", "")),
                          bool(e.get("suspected", False)), str(e.get("node", "")))
                    for e in raw]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("stragglers: record unreadable; starting afresh", path=self.path,
                        error=str(exc))
            return []

    def add(self, entry: Entry, now: float, window_s: float) -> list[Entry]:
        """Add one naming (one per job and node: a job's ranks, or a job's whole node, already
        in the record is updated), drop what is older than ``window_s``; returns the entries
        kept. A job already counted towards a suspect drain stays counted, so naming more of
        its ranks (or the whole node) never counts it again."""
        with self.lock:
            loaded = self.load()
            if any(e.job_id == entry.job_id and e.suspected for e in loaded):
                entry = replace(entry, suspected=True)
            kept = [e for e in loaded if now - e.at < window_s
                    and (e.job_id, e.node) != (entry.job_id, entry.node)]
            kept = [*kept, entry][-MAX_ENTRIES:]
            self._write(kept)
        return kept

    def mark_suspected(self, job_ids: Iterable[int]) -> None:
        """Mark these jobs' entries as counted towards a suspect drain."""
        ids = set(job_ids)
        with self.lock:
            self._write([replace(e, suspected=True) if e.job_id in ids else e
                         for e in self.load()])

    def _write(self, kept: list[Entry]) -> None:
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o755, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump([{"at": e.at, "job_id": e.job_id, "ranks": list(e.ranks),
                        "slowdown": round(e.slowdown, 4), "user": e.user,
                        "suspected": e.suspected, "node": e.node} for e in kept], fh)
        os.replace(tmp, self.path)


def recent(entries: list[Entry], now: float, window_s: float) -> list[Entry]:
    return [e for e in entries if now - e.at < window_s]


def jobs_of(entries: list[Entry]) -> int:
    """Distinct jobs (a job may have its ranks and its whole node named)."""
    return len({e.job_id for e in entries})


def users_of(entries: list[Entry]) -> int:
    """Distinct known users whose jobs named this node."""
    return len({e.user for e in entries if e.user})


def recurring(entries: list[Entry]) -> bool:
    """Pure: the node is named a (recurring) straggler only when jobs of at least
    :data:`MIN_USERS` different users were slow on it: one user's slow ranks are that user's
    own doing (user code can sleep), not a fact about the node."""
    return users_of(entries) >= MIN_USERS


def suspicion(entries: list[Entry], need: int) -> list[Entry]:
    """Pure: the entries that make this node a suspect, or [] while they don't.

    Not yet counted towards a suspect drain (so one run of slowness drains at most once),
    from ``need`` different jobs or more, of at least :data:`MIN_USERS` different known
    users: a slow step time is the job's own word, and one user's deliberately slow jobs
    must not take a node out of service; other users' jobs slow on the same node are
    evidence about the node."""
    fresh = [e for e in entries if not e.suspected]
    if not need or len({e.job_id for e in fresh}) < need:
        return []
    if len({e.user for e in fresh if e.user}) < MIN_USERS:
        return []
    return fresh
