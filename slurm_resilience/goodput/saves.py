"""Checkpoint save times the training processes report to their node agent
(``metrics.ckpt_saved``, sent by the local leader's background writer after each save).

Kept in memory per job and run, bounded; the job's owner (or root) may report, nobody else.
They feed goodput (a run's stall time) and the save metrics; the request keeps the name it
was first given (``metrics.``), which the training side sends.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.heartbeat import attempt

MAX_JOBS = 1024
MAX_SECONDS = 1e6


@dataclass(frozen=True)
class SaveStats:
    run: int
    step: int = -1
    saves: int = 0
    last_stall_s: float = 0.0
    max_stall_s: float = 0.0
    total_stall_s: float = 0.0
    last_write_s: float = 0.0


def _seconds(request: Mapping[str, Any], key: str) -> float:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise RequestError(f"metrics: ckpt_saved: {key} {value!r} is not a number of seconds")
    return float(value)


def _count(request: Mapping[str, Any], key: str, limit: int) -> int:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise RequestError(f"metrics: ckpt_saved: {key} {value!r} is not an integer in "
                           f"0..{limit}")
    return value


class SaveBook:
    def __init__(self) -> None:
        self.jobs: dict[int, SaveStats] = {}
        self.lock = threading.Lock()

    def report(self, request: Mapping[str, Any], peer: Peer, owner_uid: int | None) -> None:
        """Record one save; ``owner_uid`` is the job's owner on this node (None: unknown)."""
        job_id = _count(request, "job_id", 2**63 - 1)
        if owner_uid is None:
            raise RequestError(f"metrics: ckpt_saved: job {job_id} is not running on this node")
        if peer.uid not in (0, owner_uid):
            raise RequestError(f"metrics: ckpt_saved: job {job_id} belongs to uid {owner_uid}, "
                               f"not to you (uid {peer.uid})")
        run = _count(request, "run", attempt.MAX_ATTEMPT)
        step = _count(request, "step", 2**62)
        stall, write = _seconds(request, "stall_s"), _seconds(request, "write_s")
        with self.lock:
            st = self.jobs.get(job_id)
            if st is None or st.run != run:
                if st is None and len(self.jobs) >= MAX_JOBS:
                    raise RequestError("metrics: ckpt_saved: too many jobs on this node")
                st = SaveStats(run)
            self.jobs[job_id] = replace(st, step=step, saves=st.saves + 1, last_stall_s=stall,
                                        last_write_s=write, max_stall_s=max(st.max_stall_s,
                                                                            stall),
                                        total_stall_s=st.total_stall_s + stall)

    def keep_only(self, job_ids: set[int]) -> None:
        with self.lock:
            for gone in set(self.jobs) - job_ids:
                del self.jobs[gone]

    def snapshot(self) -> dict[int, SaveStats]:
        with self.lock:
            return dict(self.jobs)  # the stats are frozen: replaced, never changed
