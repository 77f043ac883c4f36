"""The agent's Prometheus collector: reads the agent's in-memory state and a few small
node files at scrape time, instead of instrumenting every call site.

Sources, each read through its snapshot: the hang watcher's job views, the stragglers
service (per-job step times, straggler ranks and nodes), the goodput service (run timelines,
save times), the uploader's journal records (backlog, commit latency, stage-in), the
node's events file (:mod:`.events`: drains, returns, requeues, holds, incidents, gate
results), the NCCL test's cached result, and the agent itself. A source that fails is
counted in ``slurm_resilience_agent_collect_errors`` and logged; the rest is still served.

Per-job series carry a ``job_id`` label and end with the job (a collector yields only the
jobs present now); long-lived series have no job label.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slurm_resilience import __version__, events
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.goodput import compute as goodput
from slurm_resilience.goodput.saves import SaveStats
from slurm_resilience.goodput.service import GoodputSnapshot
from slurm_resilience.health import nvlink_domain
from slurm_resilience.log import get_logger
from slurm_resilience.metrics import observe
from slurm_resilience.metrics.configstate import ConfigWatch
from slurm_resilience.nccl import cache as nccl_cache
from slurm_resilience.stragglers.record import jobs_of, users_of
from slurm_resilience.stragglers.service import StragglerSnapshot
from slurm_resilience.uploader.journal import StepState, failed_steps, pending_steps

log = get_logger("metrics")

P = "slurm_resilience_"
GATE_RESULTS = ("ok", "warn", "unknown", "fail")
EVENT_FAMILIES = {
    events.DRAIN: ("node_drains", "nodes this node's hooks and agent put into our drain "
                   "(a node already in one of our drains is not counted again)", "cause"),
    events.RESUME: ("node_returns", "nodes returned to service (our drains resumed)", "cause"),
    events.REQUEUE: ("job_requeues", "jobs sent back to the queue: by hang handling (a "
                     "requeue held while its exclusions are set included), after our "
                     "prolog failed them, after a node fault killed them (node_fault), or "
                     "ahead of their time limit once they saved (time_limit)", "cause"),
    events.PLANNED: ("planned_stops", "jobs that saved their newest step and stopped on a "
                     "warning ahead of their time limit or on preemption, by cause: planned "
                     "restarts, never counted against the hang requeue cap", "cause"),
    events.HOLD: ("job_holds", "jobs requeued and left held by hang handling", "cause"),
    events.CANCEL: ("job_cancels", "hung jobs cancelled (no_requeue_policy: cancel)", "cause"),
    events.INCIDENT: ("hang_incidents", "hang incidents decided on this node (the job's batch "
                      "host; each incident once), by decision", "decision"),
    events.NODE_LOSS: ("node_losses", "step nodes of a slurm-resilience launch that Slurm "
                       "showed lost (down, not responding, failing, or drained by us) when "
                       "the step failed, by decision: relaunched on a spare inside the "
                       "allocation, requeued away from the node, or left (not requeueable "
                       "or the node-fault cap spent)", "decision"),
    events.BUDDY: ("buddy_copies", "buddy copies of checkpoint parts (a node's part of its "
                   "newest step, kept on the next node of the job), by result: sent by this "
                   "node, received and verified here, used by a restore here, refused (by the "
                   "receiver, or here), failed on the way, or uploaded to S3 here for a node "
                   "no longer in the job", "result"),
    events.BUDDY_BYTES: ("buddy_copy_bytes", "bytes of checkpoint files this node sent to or "
                         "received from another node's agent as buddy copies and restores' "
                         "pulls, or uploaded to S3 from a copy held here", "direction"),
    events.STRAGGLER: ("straggler_namings", "jobs in which this node was named a straggler",
                       "cause"),
    events.BUDGET: ("hang_budget_spent", "times hang handling left a suspect in service "
                    "because the hourly suspect budget (heartbeat.budget_per_user_per_hour, "
                    "budget_per_hour) was spent, by what blamed it; drains on evidence are "
                    "never held back", "by"),
    events.SUSPICION: ("suspicion_deep_verifications", "deeper verifications of this node "
                       "after jobs of heartbeat.suspect_threshold different users suspected it "
                       "within suspect_window_s, by outcome (cleared: returned to service, "
                       "not drained; failed: drained for the failed check)", "outcome"),
    events.CKPT_AGENT: ("checkpoint_agent_unreachable", "jobs with checkpoint staging whose "
                        "prolog or epilog couldn't reach this node's agent (no stage-in, no "
                        "upload)", "hook"),
}


class StragglerSource(Protocol):
    """The stragglers service (stragglers.service.StragglerService)."""

    def snapshot(self) -> StragglerSnapshot: ...


class GoodputSource(Protocol):
    """The goodput service (goodput.service.GoodputService)."""

    def snapshot(self) -> GoodputSnapshot: ...


@dataclass
class AgentSources:
    """What the collector reads; every part may be absent (service off)."""

    node: str
    events_path: str
    nccl_path: str
    started: float = field(default_factory=time.time)
    watcher: Any = None  # hang.watcher.HangWatcher
    uploader: Any = None  # uploader.service.Uploader
    stragglers: StragglerSource | None = None
    goodput: GoodputSource | None = None
    agent: Any = None  # agent.daemon.Agent (server stats, tick failures)
    services: tuple[str, ...] = ()
    nvlink_path: str = ""  # the health gate's NVLink domain record (GB200 NVL72)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, labels=labels)


class AgentCollector(Collector):
    def __init__(self, sources: AgentSources, clock: Clock = SystemClock()):
        self.s = sources
        self.clock = clock
        self.errors: dict[str, int] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.config = ConfigWatch()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            errors: dict[str, int] = {}
            parts: list[tuple[str, Callable[[], Iterator[Metric]]]] = [
                ("agent", self._agent), ("events", self._events), ("heartbeat", self._jobs),
                ("checkpoint", self._checkpoint), ("nccl", self._nccl),
                ("nvlink", self._nvlink)]
            out: list[Metric] = []
            for part, fn in parts:
                try:
                    out.extend(fn())
                except Exception as exc:  # noqa: BLE001 - one source must not blank the rest
                    errors[part] = 1
                    if part not in self._warned:  # once per part until it works again
                        log.warning("metrics: couldn't collect", part=part,
                                    error=f"{type(exc).__name__}: {exc}")
                        self._warned.add(part)
                    continue
                self._warned.discard(part)
            g = _gauge("agent_collect_errors", "sources of the agent's metrics that failed "
                       "in this scrape (their series are missing; see the agent's log)",
                       ["source"])
            for part, _ in parts:
                g.add_metric([part], errors.get(part, 0))
            out.append(g)
        yield from out

    # -- the agent itself --------------------------------------------------------------------

    def _agent(self) -> Iterator[Metric]:
        g = _gauge("agent_info", "the agent on this node (value is always 1)",
                   ["node", "version"])
        g.add_metric([self.s.node, __version__], 1)
        yield g
        g = _gauge("agent_start_time_seconds", "Unix time the agent started")
        g.add_metric([], self.s.started)
        yield g
        g = _gauge("agent_service_up", "agent services running (1) on this node", ["service"])
        for name in self.s.services:
            g.add_metric([name], 1)
        yield g
        g = _gauge("agent_threads", "threads in the agent process")
        g.add_metric([], threading.active_count())
        yield g
        yield from self.config.metrics()
        yield from observe.metrics(self.s.events_path, self.config.current().cfg.mode)
        agent = self.s.agent
        if agent is None:
            return
        c = _counter("agent_service_tick_failures", "service ticks that raised", ["service"])
        for name in self.s.services:
            c.add_metric([name], agent.tick_failures.get(name, 0))
        yield c
        stats = agent.server.stats
        c = _counter("agent_requests", "socket connections admitted", [])
        c.add_metric([], stats.admitted)
        yield c
        c = _counter("agent_requests_refused", "socket requests refused, by why", ["why"])
        for why, n in (("busy", stats.busy), ("timed_out", stats.timed_out),
                       ("too_big", stats.too_big), ("accept_error", stats.accept_errors)):
            c.add_metric([why], n)
        yield c
        g = _gauge("agent_connections", "socket connections being served now")
        g.add_metric([], agent.server.connections())
        yield g

    # -- counters kept on disk ---------------------------------------------------------------

    def _events(self) -> Iterator[Metric]:
        doc = events.read(self.s.events_path) if self.s.events_path else events.empty()
        families = {kind: _counter(name, doc_, [label])
                    for kind, (name, doc_, label) in EVENT_FAMILIES.items()}
        gate = _counter("gate_check_results", "gate check runs, by check and result",
                        ["check", "result"])
        counts: dict[str, dict[str, int]] = {
            kind: dict.fromkeys(events.KNOWN_CAUSES.get(kind, ()), 0) for kind in families}
        checks = dict.fromkeys(f"{c}:{r}" for c in (*events.KNOWN_CAUSES[events.GATE],
                                                    *doc["gate"]) for r in GATE_RESULTS)
        gates = dict.fromkeys(checks, 0)
        for key, n in doc["counters"].items():
            kind, _, cause = key.partition("|")
            if kind == events.GATE:
                gates[cause] = n
            elif kind in counts:
                counts[kind][cause] = n
        for kind, by_cause in counts.items():
            for cause, n in sorted(by_cause.items()):
                families[kind].add_metric([cause], n)
        for key, n in sorted(gates.items()):
            check, _, result = key.partition(":")
            gate.add_metric([check, result], n)
        yield from families.values()
        yield gate
        last = _gauge("gate_check_last_result", "the last result of each gate check: 1 for "
                      "its result, 0 for the others", ["check", "result"])
        at = _gauge("gate_check_last_run_timestamp_seconds", "Unix time of each check's last "
                    "run", ["check"])
        for check, r in sorted(doc["gate"].items()):
            for result in GATE_RESULTS:
                last.add_metric([check, result], 1 if r["result"] == result else 0)
            at.add_metric([check], r["at"])
        yield last
        yield at
        out = _gauge("node_our_drain_since_timestamp_seconds", "while this node is in a drain "
                     "of ours: Unix time its agent first saw it there (it looks every "
                     "heartbeat.verify_idle_poll_s), by the drain's cause", ["cause"])
        mine = doc["out"].get(self.s.node)
        if mine is not None:
            out.add_metric([mine["cause"]], mine["since"])
        yield out

    # -- heartbeat -----------------------------------------------------------------------------

    def _jobs(self) -> Iterator[Metric]:
        w = self.s.watcher
        if w is None:
            return
        snap = w.snapshot()
        views = list(snap.jobs.values())
        g = _gauge("jobs_watched", "jobs whose heartbeat this node's agent watches")
        g.add_metric([], len(views))
        yield g
        ranks = _gauge("job_ranks", "ranks of the job on this node", ["job_id"])
        hung = _gauge("job_hung_ranks", "ranks of the job on this node past their timeout",
                      ["job_id"])
        for v in views:
            job = str(v.record.job_id)
            ranks.add_metric([job], len(v.slots))
            hung.add_metric([job], len(v.verdict.hung))
        yield ranks
        yield hung
        open_ = snap.open_incidents
        inc = _gauge("job_hang_incident_open", "1 while a hang incident of the job is being "
                     "handled on this node", ["job_id"])
        for job_id in open_:
            inc.add_metric([str(job_id)], 1)
        yield inc
        suspects = getattr(w, "suspects", None)  # hang.suspect.SuspectWatch
        if suspects is not None:
            g = _gauge("node_suspicion_users", "users whose jobs made this node a hang suspect "
                       "within heartbeat.suspect_window_s (each suspicion verified; at "
                       "suspect_threshold the node gets the deeper verification)")
            g.add_metric([], suspects.recent_users())
            yield g
        if self.s.stragglers is not None:
            yield from self._stragglers(self.s.stragglers.snapshot())
        elif self.s.goodput is not None:
            yield from self._goodput(self.s.goodput.snapshot())

    def _stragglers(self, snap: StragglerSnapshot) -> Iterator[Metric]:
        p50 = _gauge("job_step_time_p50_seconds", "median step time of the job's ranks on "
                     "this node over their recent window", ["job_id"])
        p95 = _gauge("job_step_time_p95_seconds", "95th percentile step time of the job's "
                     "ranks on this node over their recent window", ["job_id"])
        samples = _gauge("job_step_time_samples", "step times in the job's windows on this "
                         "node (all ranks); the quantiles are over these", ["job_id"])
        slow = _gauge("job_straggler_ranks", "ranks of the job on this node named stragglers",
                      ["job_id"])
        for s in snap.jobs:
            samples.add_metric([str(s.job_id)], s.samples)
            if s.samples:
                p50.add_metric([str(s.job_id)], s.p50_s)
                p95.add_metric([str(s.job_id)], s.p95_s)
            slow.add_metric([str(s.job_id)], len(s.straggler_ranks))
        yield samples
        yield p50
        yield p95
        yield slow
        g = _gauge("job_straggler_node_slowdown_ratio", "while the job's judging agent names "
                   "this node a straggler (persistently slower than the job's other nodes): "
                   "its median step time over the job's, minus one", ["job_id"])
        for job_id, v in snap.named_here:
            g.add_metric([str(job_id)], round(v.slowdown, 4))
        yield g
        g = _gauge("job_straggler_nodes", "nodes of the job named stragglers by this node, "
                   "the job's judging agent (its first node)", ["job_id"])
        for job_id, named in sorted(snap.judged_now.items()):
            g.add_metric([str(job_id)], len(named))
        yield g
        if self.s.goodput is not None:
            yield from self._goodput(self.s.goodput.snapshot())
        g = _gauge("node_straggler_recent_jobs", "jobs in which this node (ranks of it, or "
                   "the whole node) was named a straggler within stragglers.record_window_s")
        g.add_metric([], jobs_of(list(snap.recent)))
        yield g
        g = _gauge("node_straggler_recent_users", "different users whose jobs named this node "
                   "a straggler within stragglers.record_window_s; the node is called a "
                   "recurring straggler only from 2 (one user's slow ranks are their own)")
        g.add_metric([], users_of(list(snap.recent)))
        yield g

    def _goodput(self, snap: GoodputSnapshot) -> Iterator[Metric]:
        ratio = _gauge("job_goodput_ratio", "productive share of the job's allocated time on "
                       "this node so far (slurm-resilience goodput JOBID has the breakdown)",
                       ["job_id"])
        lost = _gauge("job_goodput_lost_seconds", "the job's allocated time on this node "
                      "lost so far, by kind; kind=unexplained is what productive time (from "
                      "step times) and the other kinds leave, negative where they overlap",
                      ["job_id", "kind"])
        for job_id, runs in sorted(snap.runs.items()):
            if not runs:
                continue
            b = goodput.breakdown(job_id, list(runs), last_over=False)
            if b.allocated_s <= 0:
                continue
            ratio.add_metric([str(job_id)], b.ratio)
            for kind, seconds in b.losses.items():
                lost.add_metric([str(job_id), kind], seconds)
            lost.add_metric([str(job_id), "unexplained"], b.unexplained_s)
        yield ratio
        yield lost

    # -- checkpoint ----------------------------------------------------------------------------

    def _checkpoint(self) -> Iterator[Metric]:
        if self.s.goodput is not None:
            yield from self._saves(self.s.goodput.snapshot().saves)
        up = self.s.uploader
        if up is None:
            return
        recs = [(int(r["job_id"]), r) for r in up.snapshot().jobs.values()]
        rows = [self._ckpt_row(job_id, rec) for job_id, rec in sorted(recs)]
        fams = {
            "steps": _gauge("checkpoint_upload_backlog_steps", "checkpoint steps committed on "
                            "this node and not yet committed in S3", ["job_id"]),
            "bytes": _gauge("checkpoint_upload_backlog_bytes", "bytes of those steps not yet "
                            "in S3 (steps whose upload began)", ["job_id"]),
            "failed": _gauge("checkpoint_upload_failed_steps", "steps that will never reach "
                             "S3", ["job_id"]),
            "latency": _gauge("checkpoint_commit_latency_seconds", "the newest S3-committed "
                              "step: from seen on this node to committed in S3", ["job_id"]),
            "committed": _gauge("checkpoint_last_commit_timestamp_seconds", "Unix time the "
                                "newest step was committed in S3", ["job_id"]),
            "si_s": _gauge("checkpoint_stagein_duration_seconds", "how long the job's last "
                           "stage-in took", ["job_id"]),
            "si_b": _gauge("checkpoint_stagein_bytes", "bytes the job's last stage-in "
                           "fetched", ["job_id"]),
            "lost": _gauge("checkpoint_unreachable_agent_nodes", "the job's other nodes whose "
                           "agent its ranks couldn't reach (their checkpoints never reach S3)",
                           ["job_id"]),
        }
        for job_id, row in rows:
            for key, value in row.items():
                if value is not None:
                    fams[key].add_metric([str(job_id)], value)
        total = _gauge("checkpoint_upload_backlog_node_bytes", "bytes waiting for S3 on "
                       "this node, all jobs")
        total.add_metric([], sum(r["bytes"] or 0 for _, r in rows))
        yield from fams.values()
        yield total

    @staticmethod
    def _saves(saves: Mapping[int, SaveStats]) -> Iterator[Metric]:
        last = _gauge("checkpoint_save_stall_last_seconds", "how long the job's last save() "
                      "stalled training (this node's local leader)", ["job_id"])
        peak = _gauge("checkpoint_save_stall_max_seconds", "the longest save() stall of the "
                      "job's current run", ["job_id"])
        total = _counter("checkpoint_save_stall_seconds", "training time spent in save() "
                         "stalls in the job's current run", ["job_id"])
        count = _counter("checkpoint_saves", "saves of the job's current run", ["job_id"])
        write = _gauge("checkpoint_save_write_seconds", "how long the job's last save took "
                       "to be written and committed on this node", ["job_id"])
        for job_id, st in sorted(saves.items()):
            j = [str(job_id)]
            last.add_metric(j, st.last_stall_s)
            peak.add_metric(j, st.max_stall_s)
            total.add_metric(j, st.total_stall_s)
            count.add_metric(j, st.saves)
            write.add_metric(j, st.last_write_s)
        yield from (last, peak, total, count, write)

    @staticmethod
    def _ckpt_row(job_id: int, rec: Any) -> tuple[int, dict[str, float | None]]:
        steps = rec.get("steps", {})
        pending = pending_steps(rec)
        backlog = 0
        for s in pending:
            st = steps.get(str(s), {})
            done = sum(int(p.get("size", 0)) for f in st.get("files", {}).values()
                       for p in f.get("parts", {}).values())
            backlog += max(0, int(st.get("bytes", 0)) - done)
        committed = [(int(s), st) for s, st in steps.items()
                     if st.get("state") == StepState.COMMITTED and st.get("committed_at")]
        latency = last_commit = None
        if committed:
            _, st = max(committed, key=lambda kv: kv[0])
            last_commit = float(st["committed_at"])
            if st.get("since"):
                latency = max(0.0, last_commit - float(st["since"]))
        si = rec.get("stagein") or {}
        si_s = float(si["seconds"]) if si.get("state") in ("done", "failed") and \
            si.get("seconds") is not None else None
        si_b = float(si.get("fetched_bytes") or 0) if si.get("state") == "done" else None
        return job_id, {"steps": len(pending), "bytes": backlog,
                        "failed": len(failed_steps(rec)), "latency": latency,
                        "committed": last_commit, "si_s": si_s, "si_b": si_b,
                        "lost": len(rec.get("unreachable_nodes") or [])}

    # -- NCCL ------------------------------------------------------------------------------------

    def _nccl(self) -> Iterator[Metric]:
        entry = nccl_cache.read(self.s.nccl_path) if self.s.nccl_path else None
        bw = _gauge("nccl_bus_bandwidth_bytes_per_second", "bus bandwidth of the last NCCL "
                    "loopback test, at its largest size", ["variant"])
        th = _gauge("nccl_bus_bandwidth_threshold_bytes_per_second", "the bus bandwidth the "
                    "test must reach", ["variant"])
        ok = _gauge("nccl_test_passed", "whether the last NCCL test passed (1) or not (0), "
                    "by variant; variant=\"all\" is the test's own verdict", ["variant"])
        at = _gauge("nccl_test_timestamp_seconds", "Unix time of the last NCCL test")
        if entry and not entry.get("corrupt"):
            ok.add_metric(["all"], 1 if entry.get("verdict") == "pass" else 0)
            at.add_metric([], float(entry.get("finished_at") or entry.get("cached_at") or 0))
            for v in entry.get("variants", []):
                ok.add_metric([str(v.get("variant"))], 1 if v.get("verdict") == "pass" else 0)
                sizes = {int(k): float(x) for k, x in (v.get("busbw_gbps") or {}).items()}
                if sizes:
                    bw.add_metric([str(v.get("variant"))], sizes[max(sizes)] * 1e9)
                expected = v.get("expected_gbps")
                if expected is not None:
                    th.add_metric([str(v.get("variant"))], float(expected) * 1e9)
        elif entry and entry.get("corrupt"):
            raise ValueError(f"{self.s.nccl_path}: unreadable NCCL result")
        yield from (bw, th, ok, at)


    def _nvlink(self) -> Iterator[Metric]:
        """The node's NVLink domain as its health gate last recorded it: what
        ``topology generate --from-agents`` groups nodes into Slurm blocks by."""
        yield from nvlink_metrics(nvlink_domain.read(self.s.nvlink_path)
                                  if self.s.nvlink_path else None)


def nvlink_metrics(rec: nvlink_domain.NodeFabric | None) -> list[Metric]:
    info = _gauge("gpu_nvlink_domain_info", "1 per GPU in an NVLink fabric: its domain "
                  "(NVML fabric cluster UUID and clique id)", ["gpu", "cluster_uuid", "clique_id"])
    fields = {name: _gauge(f"gpu_fabric_{name}", doc, ["gpu"]) for name, doc in (
        ("state", "NVML fabric registration state (3: COMPLETED)"),
        ("status", "NVML fabric probe status (0: success)"),
        ("health_mask", "NVML fabric health mask (V3; 2-bit fields, 1 = fault)"),
        ("health", "NVML fabric health summary (1: HEALTHY, 2: UNHEALTHY, 3: "
                   "LIMITED_CAPACITY)"))}
    at = _gauge("gpu_nvlink_domain_timestamp_seconds", "when the health gate read it")
    if rec is not None:
        at.add_metric([], rec.time)
        for g in rec.gpus:
            gpu = str(g.index)
            info.add_metric([gpu, g.cluster_uuid or "", str(g.clique_id or 0)], 1)
            for name, value in (("state", g.state), ("status", g.status),
                                ("health_mask", g.health_mask),
                                ("health", g.health_summary)):
                if value is not None:
                    fields[name].add_metric([gpu], value)
    return [info, *fields.values(), at]


def nccl_path(state_dir: str, node: str) -> str:
    return nccl_cache.path_for(state_dir, node)
