"""This node's persistent straggler record: the jobs it was named a straggler in.

One small root-owned JSON file, replaced atomically, bounded to :data:`MAX_ENTRIES`
entries and to the configured window. It survives agent restarts, so a node that is slow
again and again, in job after job, shows as recurring (``status``, the metrics) and can be
made a suspect.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from slurm_resilience.log import get_logger

log = get_logger("stragglers")

FILENAME = "stragglers.json"
MAX_ENTRIES = 256
MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    at: float  # Unix time it was named
    job_id: int
    ranks: tuple[int, ...]
    slowdown: float  # its median over the job's, minus one (0.2: 20% slower)


class StragglerRecord:
    def __init__(self, path: str):
        self.path = path

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
                          float(e["slowdown"])) for e in raw]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("stragglers: record unreadable; starting afresh", path=self.path,
                        error=str(exc))
            return []

    def add(self, entry: Entry, now: float, window_s: float) -> list[Entry]:
        """Add one naming (one per job: a job already in the record is updated), drop what is
        older than ``window_s``; returns the entries kept."""
        kept = [e for e in self.load() if now - e.at < window_s and e.job_id != entry.job_id]
        kept = [*kept, entry][-MAX_ENTRIES:]
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o755, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump([{"at": e.at, "job_id": e.job_id, "ranks": list(e.ranks),
                        "slowdown": round(e.slowdown, 4)} for e in kept], fh)
        os.replace(tmp, self.path)
        return kept


def recent(entries: list[Entry], now: float, window_s: float) -> list[Entry]:
    return [e for e in entries if now - e.at < window_s]
