"""Stand-ins for the agent state that unit tests feed the collector, the step watch and
goodput: heartbeat slot and job views, the hang watcher's and the uploader's attributes,
a checkpoint journal record, and the samples of a Prometheus exposition."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.goodput.saves import SaveBook
from slurm_resilience.goodput.service import GoodputSnapshot
from slurm_resilience.goodput.service import snapshot_of as goodput_snapshot
from slurm_resilience.hang import detect, jobrecord
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.hang.watcher import WatcherSnapshot
from slurm_resilience.heartbeat.slot import SlotView
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.nodeexchange import NodeExchange
from slurm_resilience.stragglers.service import StragglerSnapshot
from slurm_resilience.stragglers.service import snapshot_of as straggler_snapshot
from slurm_resilience.stragglers.synthetic import steps
from slurm_resilience.uploader.service import UploaderSnapshot


def slot(rank: int, step: int, dt: float, job_id: int) -> SlotView:
    return SlotView(rank=rank, world_size=8, local_rank=rank, pid=100 + rank, pid_start=1,
                    job_id=job_id, restart_count=0, clock_offset=0.0, created=0.0,
                    job_step_timeout_s=0.0, flags=0, step=step, last_beat=float(step),
                    beats=step, last_dt=dt, ewma_dt=dt, min_dt=dt, max_dt=dt, ckpt_step=-1,
                    section_start=0.0, section_timeout_s=0.0, section="")


def view(job_id: int, slots: list[SlotView]) -> JobView:
    rec = jobrecord.JobRecord(job_id=job_id, uid=1000, gid=1000, user="alice", started=0.0)
    verdict = detect.judge(job_id, slots, 0.0, HeartbeatSection(),
                           alive={s.rank: True for s in slots})
    return JobView(rec, slots, verdict)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Suspects:
    """What the collector reads of HangWatcher's SuspectWatch."""

    def __init__(self, users: int = 0) -> None:
        self.users = users

    def recent_users(self) -> int:
        return self.users


class Watcher:
    """The attributes of HangWatcher the collector reads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[int, Any] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.suspects = Suspects()

    def snapshot(self) -> WatcherSnapshot:
        with self.lock:
            return WatcherSnapshot(dict(self.jobs), tuple(
                sorted(k for k, t in self.threads.items() if k >= 0 and t.is_alive())))


@dataclass
class JobNodes:
    """The fields of a job record (the prolog's) the buddy service reads."""

    uid: int
    nodes: tuple[str, ...]


@dataclass
class _JobView:
    record: JobNodes


@dataclass
class _Jobs:
    jobs: dict[int, _JobView]


class BuddyWatcher:
    """The hang watcher as the buddy service reads it: its live config, the jobs running
    here (``jobs``: job → its owner and nodes) and the agents' exchange (a transport, or
    None for none)."""

    def __init__(self, cfg: Config, transport: Any = None,
                 jobs: dict[int, JobNodes] | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.jobs: dict[int, JobNodes] = dict(jobs or {})

    def snapshot(self) -> _Jobs:
        return _Jobs({j: _JobView(r) for j, r in self.jobs.items()})

    def exchange(self) -> Any:
        return self.transport


class Uploads:
    """The two attributes of Uploader the collector reads, with real journal records."""

    def __init__(self, jobs: dict[int, dict[str, Any]]) -> None:
        self.lock = threading.RLock()
        self.jobs = jobs

    def snapshot(self) -> UploaderSnapshot:
        with self.lock:
            return UploaderSnapshot(copy.deepcopy(self.jobs))  # type: ignore[arg-type]


class Stragglers:
    """The stragglers service as the collector reads it: the snapshot of a real step watch
    (and node exchange) that a test feeds itself."""

    def __init__(self, steps: StepWatch, nodes: NodeExchange | None = None) -> None:
        self.steps = steps
        self.nodes = nodes

    def snapshot(self) -> StragglerSnapshot:
        return straggler_snapshot(self.steps, self.nodes)


class Goodput:
    """The goodput service as the collector reads it: the snapshot of a real ledger and
    save book that a test feeds itself."""

    def __init__(self, ledger: Ledger | None = None, saves: SaveBook | None = None) -> None:
        self.ledger = ledger
        self.saves = saves

    def snapshot(self) -> GoodputSnapshot:
        return goodput_snapshot(self.ledger, self.saves)


def journal_record(job_id: int) -> dict[str, Any]:
    return {"job_id": job_id, "uid": 1000, "gid": 1000, "user": "alice",
            "staging_root": "/x", "uri": "s3://ckpt/alice/run", "state": "active",
            "ended_at": None,
            "stagein": {"state": "done", "step": 100, "source": "s3", "mode": "whole",
                        "fetched_bytes": 3 << 20, "fallbacks": [], "seconds": 4.5,
                        "started": 10.0, "finished": 14.5},
            "steps": {"100": {"state": "committed", "files": {}, "since": 1000.0,
                              "committed_at": 1012.5},
                      "200": {"state": "pending", "bytes": 10 << 20, "since": 2000.0,
                              "files": {"k": {"done": False, "parts": {
                                  "1": {"etag": "e", "size": 4 << 20, "crc32c": "c"}}}}},
                      "300": {"state": "pending", "files": {}, "since": 3000.0},
                      "50": {"state": "failed", "reason": "403", "files": {}}}}


def feed(watcher: Watcher, watch: StepWatch, job_id: int, count: int,
         slow_rank: int | None = None) -> None:
    """``count`` steps of an 8-rank job into the hang watcher's view and the step watch."""
    for i, row in enumerate(steps(8, count, job_id)):
        v = view(job_id, [slot(r, i + 1, x * (1.5 if r == slow_rank else 1), job_id)
                          for r, x in enumerate(row)])
        with watcher.lock:
            watcher.jobs[job_id] = v
        watch.observe(list(watcher.jobs.values()))
