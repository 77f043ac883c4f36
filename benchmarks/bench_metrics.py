"""CPU the agent spends on metrics: 8 jobs of 8 ranks on the node, one scrape every 15 s.

Ours: per 15 s, one scrape over HTTP of the agent's collector (the whole /metrics text:
every job's step-time quantiles from 8 x 100-sample windows, goodput, the journal rows, the
events file, the NCCL result) plus the step watch's and the goodput ledger's feeding at
every heartbeat tick (the default heartbeat.interval_s, 15 ticks of 1 s). Reference: one
core for 15 s. Goal: <= 1%. A second reference puts the scrape beside the hang watcher's
own work: decoding the same 64 heartbeat slots once.

    .venv/bin/python benchmarks/bench_metrics.py
"""

from __future__ import annotations

import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from slurm_resilience import events
from slurm_resilience.clock import SystemClock
from slurm_resilience.config import Config
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.hang import detect, jobrecord
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.heartbeat import slot as S
from slurm_resilience.metrics import http
from slurm_resilience.metrics.collector import AgentCollector, AgentSources
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.record import StragglerRecord

JOBS, RANKS, SCRAPE_S, TICK_S = 8, 8, 15.0, 1.0


def make_slot(job: int, rank: int, step: int) -> S.SlotView:
    dt = 1.0 + 0.01 * ((rank * 7 + step) % 5)
    return S.SlotView(rank, RANKS, rank, 1000 + rank, 1, job, 0, 0.0, 0.0, 0.0, 0, step,
                      float(step), step, dt, dt, dt, dt, -1, 0.0, 0.0, "")


def views(step: int) -> list[JobView]:
    out = []
    for job in range(JOBS):
        slots = [make_slot(job, r, step) for r in range(RANKS)]
        rec = jobrecord.JobRecord(job, 1000, 1000, "alice", 0.0)
        out.append(JobView(rec, slots, detect.judge(job, slots, 0.0, Config().heartbeat,
                                                    alive={r: True for r in range(RANKS)})))
    return out


class Holder:
    def __init__(self, jobs: dict[int, Any]) -> None:
        self.lock = threading.RLock()
        self.jobs = jobs
        self.threads: dict[int, threading.Thread] = {}  # incidents in progress: none


def cpu(fn: Any, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    steps = StepWatch(lambda: Config().stragglers, "n1", StragglerRecord(str(tmp / "s.json")),
                      SystemClock())
    all_views = [views(i) for i in range(1, 121)]
    for v in all_views[:100]:
        steps.observe(v)  # windows full
    watcher = Holder({v.record.job_id: v for v in all_views[-1]})
    journal = {j: {"job_id": j, "uid": 1000, "gid": 1000, "user": "alice", "staging_root": "/",
                   "uri": "s3://b/r", "state": "active", "ended_at": None,
                   "stagein": {"state": "done", "seconds": 3.0, "fetched_bytes": 1 << 30},
                   "steps": {str(s): {"state": "committed", "files": {}, "since": 1.0,
                                      "committed_at": 5.0} for s in range(0, 500, 100)}}
               for j in range(JOBS)}
    ev = str(tmp / events.FILENAME)
    events.gate_results(ev, "prolog", {"gpu": "ok", "xid": "ok", "infiniband": "ok",
                                       "nvme": "ok"})
    for kind in (events.DRAIN, events.RESUME, events.REQUEUE, events.INCIDENT):
        events.count(ev, kind, "hang")
    ledger = Ledger(str(tmp / "goodput"))
    ledger.observe(all_views[-1], time.time())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(AgentSources(
        node="n1", events_path=ev, nccl_path=str(tmp / "nccl.json"), watcher=watcher,
        uploader=Holder(journal), steps=steps, ledger=ledger,
        services=("heartbeat", "checkpoint"))))
    scrape_s = cpu(lambda: generate_latest(registry), 200)
    it = iter(all_views[100:] * 50)

    def tick() -> None:  # what the metrics service does each heartbeat tick
        views_now = next(it)
        steps.observe(views_now)
        ledger.observe(views_now, time.time())

    tick_s = cpu(tick, 1000)
    raw = [S.encode_header(rank=r, world_size=JOBS * RANKS, local_rank=r, pid=1, pid_start=1,
                           job_id=1, restart_count=0, clock_offset=0.0, created=0.0,
                           job_step_timeout_s=0.0).ljust(S.SIZE, b"\0")
           for r in range(JOBS * RANKS)]
    decode_s = cpu(lambda: [S.decode(b) for b in raw], 200)
    server = http.serve("127.0.0.1", 0, registry)  # the agent's bounded server
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    http_s = cpu(lambda: urllib.request.urlopen(url, timeout=30).read(), 100)
    server.shutdown()
    server.server_close()
    per_window = http_s + tick_s * SCRAPE_S / TICK_S
    text = generate_latest(registry).decode()
    size = len(text)
    errors = [ln for ln in text.splitlines() if "collect_errors{" in ln and not ln.endswith(" 0.0")]
    assert not errors and "slurm_resilience_job_goodput_ratio{" in text, errors
    print(f"{JOBS} jobs x {RANKS} ranks: scrape {scrape_s * 1e3:.2f} ms CPU ({size} bytes), "
          f"step-watch feed {tick_s * 1e3:.3f} ms CPU per {TICK_S:g} s tick")
    print(f"scrape over HTTP: {http_s * 1e3:.2f} ms CPU (the client runs in the same "
          "process: an upper bound)")
    print(f"metrics CPU per {SCRAPE_S:g} s scrape interval: {per_window * 1e3:.2f} ms = "
          f"{per_window / SCRAPE_S:.4%} of one core (goal <= 1%)")
    print(f"scrape vs decoding the node's {JOBS * RANKS} slots once: "
          f"{scrape_s / decode_s:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
