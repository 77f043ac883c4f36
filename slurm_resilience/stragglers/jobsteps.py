"""Per-job step times on this node, from the heartbeat slots the hang watcher reads.

Each new step a rank reports adds its last step time to that rank's window (a rank that
made several steps between two readings adds one: the window is a sample, not a log).
From the windows: the job's step-time p50/p95 for the metrics, and straggler ranks named
by :mod:`.detect`. A rank named for the first time in a job adds the job to this node's
:class:`~.record.StragglerRecord`; with ``suspect_after_jobs`` set, a node named in that
many different jobs, of at least two different users (:func:`~.record.suspicion`), is
drained as a hang suspect within the hang budgets, which its own agent then verifies
(:mod:`slurm_resilience.hang.suspect`) and returns to service or keeps drained.

Everything here is bounded by the jobs on the node and the window per rank; a job's state
goes when the job leaves the hang watcher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slurm_resilience.clock import Clock
from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.hang.jobrecord import JobRecord
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.log import get_logger
from slurm_resilience.stragglers.detect import Tracker
from slurm_resilience.stragglers.nodeexchange import LocalJob
from slurm_resilience.stragglers.nodes import NodeSummary, Verdict
from slurm_resilience.stragglers.record import Entry, StragglerRecord, recent

log = get_logger("stragglers")


@dataclass(frozen=True)
class JobSteps:
    """What the metrics and ``status`` show of one job."""

    job_id: int
    ranks: int
    samples: int
    p50_s: float
    p95_s: float
    straggler_ranks: tuple[int, ...]


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


@dataclass
class _Job:
    tracker: Tracker[int]
    seen: dict[int, int]  # rank -> last step counted
    named: frozenset[int] = frozenset()
    record: JobRecord | None = None


class StepWatch:
    """Fed by the agent with the hang watcher's job views (one call per tick)."""

    def __init__(self, cfg: Callable[[], StragglerSection], node: str, record: StragglerRecord,
                 clock: Clock, on_named: Callable[[int, list[Entry]], None]
                 | None = None):
        self.cfg = cfg
        self.node = node
        self.record = record
        self.clock = clock  # its wall time stamps the record
        self.on_named = on_named
        self.jobs: dict[int, _Job] = {}
        # Jobs in which the job's judging agent named this whole node (for the metrics).
        self.named_node: dict[int, Verdict] = {}
        self.lock = threading.Lock()

    def observe(self, views: Iterable[JobView]) -> None:
        cfg = self.cfg()
        present = set()
        for view in views:
            job_id = view.record.job_id
            present.add(job_id)
            job = self.jobs.get(job_id)
            if job is None or job.tracker.cfg != cfg:
                job = _Job(Tracker(cfg), {})
            job.record = view.record
            new_step = False
            for v in view.slots:
                if v.step > job.seen.get(v.rank, -1) and v.beats > 0:
                    job.seen[v.rank] = v.step
                    if v.last_dt > 0:
                        job.tracker.add(v.rank, v.last_dt)
                        new_step = True
            if new_step:
                job.tracker.evaluate()
            newly = job.tracker.named - job.named
            job.named = job.tracker.named
            with self.lock:
                self.jobs[job_id] = job
            if newly:
                self._named(job_id, job, view.record.user)
        with self.lock:
            for gone in set(self.jobs) - present:
                del self.jobs[gone]
            for gone in set(self.named_node) - present:
                del self.named_node[gone]

    def _named(self, job_id: int, job: _Job, user: str) -> None:
        j = job.tracker.last
        ranks = sorted(job.named)
        slowdown = 0.0
        if j is not None and j.reference_s > 0:
            slowdown = max(j.medians.get(r, 0.0) for r in ranks) / j.reference_s - 1
        log.warning("straggler ranks named", job_id=job_id, ranks=ranks,
                    slowdown=round(slowdown, 3),
                    reference_s=round(j.reference_s, 4) if j else None)
        now = self.clock.time()
        try:
            kept = self.record.add(Entry(now, job_id, tuple(ranks), slowdown, user), now,
                                   self.cfg().record_window_s)
        except OSError as exc:
            log.warning("stragglers: couldn't update the node's record", path=self.record.path,
                        error=str(exc))
            return
        if self.on_named is not None:
            self.on_named(job_id, kept)

    def local_jobs(self) -> list[LocalJob]:
        """Each job's summary on this node, for the job's judging agent (node stragglers):
        the median of its ranks' windows, the longest window, its ranks, its latest step."""
        with self.lock:
            jobs = list(self.jobs.items())
        now = self.clock.time()
        out = []
        for job_id, job in sorted(jobs):
            if job.record is None:
                continue
            windows = list(job.tracker.windows.values())
            samples = [t for w in windows for t in w]
            summary = NodeSummary(self.node, quantile(samples, 0.5),
                                  max((len(w) for w in windows), default=0), len(job.seen),
                                  max(job.seen.values(), default=0), now) if samples else None
            out.append(LocalJob(job_id, job.record.user, job.record.nodes, summary))
        return out

    def node_named(self, v: Verdict) -> None:
        """The job's judging agent named this whole node: record it like ranks (the same
        record, metric, ``status`` line and suspect action), once per job."""
        with self.lock:
            job = self.jobs.get(v.job_id)
            if job is None or job.record is None:
                return
            first = v.job_id not in self.named_node
            self.named_node[v.job_id] = v
        if not first:
            return
        log.warning("straggler node: this node named slower than the rest of its job",
                    job_id=v.job_id, judge=v.judge, slowdown=round(v.slowdown, 3),
                    median_s=round(v.median_s, 4), reference_s=round(v.reference_s, 4))
        now = self.clock.time()
        try:
            kept = self.record.add(Entry(now, v.job_id, (), v.slowdown, job.record.user,
                                         node=self.node), now, self.cfg().record_window_s)
        except OSError as exc:
            log.warning("stragglers: couldn't update the node's record", path=self.record.path,
                        error=str(exc))
            return
        if self.on_named is not None:
            self.on_named(v.job_id, kept)

    def snapshot(self) -> list[JobSteps]:
        with self.lock:
            jobs = list(self.jobs.items())
        out = []
        for job_id, job in sorted(jobs):
            samples = [t for w in job.tracker.windows.values() for t in w]
            out.append(JobSteps(job_id, len(job.seen), len(samples), quantile(samples, 0.5),
                                quantile(samples, 0.95), tuple(sorted(job.named))))
        return out

    def named_here(self) -> list[tuple[int, Verdict]]:
        """The jobs whose judging agent names this node a straggler now, with the verdict."""
        with self.lock:
            return sorted(self.named_node.items())

    def recent_jobs(self) -> list[Entry]:
        return recent(self.record.load(), self.clock.time(), self.cfg().record_window_s)
