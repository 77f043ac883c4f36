"""The agent's ``goodput`` service: keeps each job's run timeline on this node (the
:class:`~.ledger.Ledger`, fed with the hang watcher's job views, the uploader's stage-in
times and the save stalls the training reports) and the save times themselves
(:class:`~.saves.SaveBook`, request ``metrics.ckpt_saved``).

Other services (metrics) read it only through :meth:`GoodputService.snapshot`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from slurm_resilience.agent.service import AgentContext, Handler, Peer, Request, Response
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.goodput.compute import Run
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.goodput.saves import SaveBook, SaveStats
from slurm_resilience.log import get_logger

log = get_logger("goodput")

LEDGER_RETENTION_S = 14 * 86400.0
LEDGER_CLEANUP_EVERY_S = 3600.0


@dataclass(frozen=True)
class GoodputSnapshot:
    """What other services (metrics) read of goodput: each job's runs on this node so far
    and the save times of each job's current run."""

    runs: Mapping[int, tuple[Run, ...]]
    saves: Mapping[int, SaveStats]


def runs_of(ledger: Ledger) -> Mapping[int, tuple[Run, ...]]:
    return MappingProxyType({job_id: tuple(r.to_run() for r in list(job.runs.values()))
                             for job_id, job in sorted(dict(ledger.jobs).items())})


def snapshot_of(ledger: Ledger | None = None, saves: SaveBook | None = None) -> GoodputSnapshot:
    return GoodputSnapshot(runs_of(ledger) if ledger is not None else MappingProxyType({}),
                           MappingProxyType(saves.snapshot() if saves is not None else {}))


class GoodputService:
    name = "goodput"

    def __init__(self, cfg: Config, node: str, services: Mapping[str, Any]):
        self.cfg = cfg
        self.node = node
        self.watcher = services.get("heartbeat")  # hang.watcher.HangWatcher: job views
        self.uploader = services.get("checkpoint")  # uploader.service.Uploader: stage-ins
        self.limits = services.get("limits")  # hang.limits.LimitWatch: planned stops
        # As often as the metrics: a run's step times are sampled one per tick.
        self.interval_s = min(cfg.heartbeat.interval_s, cfg.metrics.textfile_interval_s)
        state = node_path(cfg.node.state_dir, node)
        incidents = node_path(cfg.heartbeat.incident_dir, node) if cfg.heartbeat.incident_dir \
            else os.path.join(state, "incidents")
        self.ledger = Ledger(os.path.join(state, "goodput"), incidents)
        self.saves = SaveBook()
        self.next_cleanup = 0.0
        self.lock = threading.Lock()
        self._runs: Mapping[int, tuple[Run, ...]] = MappingProxyType({})

    def tick(self) -> None:
        if self.watcher is not None:
            views = list(self.watcher.snapshot().jobs.values())
            stalls = {j: (s.run, s.total_stall_s) for j, s in self.saves.snapshot().items()}
            # After the views: a job gone from them stopped (if it did) before this read.
            stops = self.limits.stopped_runs() if self.limits is not None else {}
            self.ledger.observe(views, time.time(), self._stagein_seconds(), stalls, stops)
        self.saves.keep_only(self._jobs_here())
        now = time.monotonic()
        if now >= self.next_cleanup:
            self.next_cleanup = now + LEDGER_CLEANUP_EVERY_S
            self.ledger.cleanup(time.time() - LEDGER_RETENTION_S)
        runs = runs_of(self.ledger)  # the ledger changes only here, on the tick
        with self.lock:
            self._runs = runs

    def snapshot(self) -> GoodputSnapshot:
        with self.lock:
            runs = self._runs
        return GoodputSnapshot(runs, MappingProxyType(self.saves.snapshot()))

    def _jobs_here(self) -> set[int]:
        jobs: set[int] = set()
        for svc in (self.watcher, self.uploader):
            if svc is not None:
                jobs |= set(svc.snapshot().jobs)
        return jobs

    def _owner(self, job_id: int) -> int | None:
        if self.uploader is not None:
            rec = self.uploader.snapshot().jobs.get(job_id)
            if rec is not None:
                return int(rec["uid"])
        if self.watcher is not None:
            view = self.watcher.snapshot().jobs.get(job_id)
            if view is not None:
                return int(view.record.uid)
        return None

    def _stagein_seconds(self) -> dict[int, float]:
        """Each job's finished stage-in time, from the uploader's records."""
        if self.uploader is None:
            return {}
        recs = list(self.uploader.snapshot().jobs.values())
        out = {}
        for rec in recs:
            si = rec.get("stagein") or {}
            if si.get("state") in ("done", "failed") and si.get("seconds") is not None:
                out[int(rec["job_id"])] = float(si["seconds"])
        return out

    def handle_ckpt_saved(self, request: Request, peer: Peer) -> Response:
        """A job's checkpoint save times, from its local leader (the job's owner)."""
        job_id = request.get("job_id")
        owner = self._owner(job_id) if isinstance(job_id, int) else None
        self.saves.report(request, peer, owner)
        return {}

    def handlers(self) -> dict[str, Handler]:
        # The request's name predates this service; the training side sends it.
        return {"metrics.ckpt_saved": self.handle_ckpt_saved}

    def close(self) -> None:
        pass


def factory(ctx: AgentContext) -> GoodputService:
    return GoodputService(ctx.cfg, ctx.node, ctx.extra.get("services", {}))
