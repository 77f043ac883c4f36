"""Auto-tuned step timeouts, persisted per job so a requeued run keeps what earlier runs
needed (root-owned files ``tune-<job>.json`` in the heartbeat state directory)."""

from __future__ import annotations

import json
import os

from slurm_resilience import safefs
from slurm_resilience.log import get_logger

log = get_logger("heartbeat.tune")


class TunedTimeouts:
    def __init__(self, state_dir: str):
        self.state_dir = state_dir
        self.cache: dict[int, float] = {}

    def path(self, job_id: int) -> str:
        return os.path.join(self.state_dir, f"tune-{int(job_id)}.json")

    def get(self, job_id: int) -> float | None:
        if job_id in self.cache:
            return self.cache[job_id]
        try:
            with open(self.path(job_id), encoding="utf-8") as fh:
                value = float(json.load(fh)["timeout_s"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("heartbeat: tune: couldn't read tuned timeout", job_id=job_id,
                        error=str(exc))
            return None
        self.cache[job_id] = value
        return value

    def save(self, job_id: int, value: float) -> None:
        self.cache[job_id] = value
        fd = safefs.makedirs_root(self.state_dir)
        try:
            safefs.replace_file(fd, f"tune-{int(job_id)}.json",
                                json.dumps({"timeout_s": value}).encode())
        finally:
            os.close(fd)

    def forget(self, job_id: int) -> None:
        """Drop the in-memory copy of an ended job (the file stays for a requeue)."""
        self.cache.pop(job_id, None)
