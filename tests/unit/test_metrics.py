"""The agent's Prometheus metrics: the events file, the collector over the agent's state,
the HTTP endpoint and the textfile, `promtool check metrics`, and the prolog's imports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_state import (
    Goodput,
    Stragglers,
    Uploads,
    Watcher,
    feed,
    journal_record,
    samples,
    slot,
    view,
)
from prometheus_client import CollectorRegistry, generate_latest

from slurm_resilience import events
from slurm_resilience.agent.daemon import Agent
from slurm_resilience.agent.service import AgentContext
from slurm_resilience.config import Config, load_text
from slurm_resilience.metrics.collector import (
    EVENT_FAMILIES,
    GATE_RESULTS,
    AgentCollector,
    AgentSources,
)
from slurm_resilience.metrics.service import MetricsService, write_textfile
from slurm_resilience.nccl import cache as nccl_cache
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.reasons import cause_of
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.record import StragglerRecord
from slurm_resilience.testing import FakeClock

REPO = Path(__file__).resolve().parents[2]


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's prometheus package"
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), \
        out.stdout + out.stderr


# -- the events file ----------------------------------------------------------------------------

def test_events_count_across_writers_and_keep_the_last_gate_results(tmp_path: Path) -> None:
    path = str(tmp_path / "state" / events.FILENAME)
    assert events.read(path) == events.empty()
    events.count(path, events.DRAIN, cause_of("SR: health: gpu3 XID 79", "SR:"))
    events.count(path, events.DRAIN, cause_of(
        "SR: hang job 7 user bob at 2026-01-01T00:00:00Z: stalled", "SR:"))
    events.count(path, events.DRAIN, cause_of(
        "SR: suspect hang job 7 user bob at 2026-01-01T00:00:00Z: x; verifying", "SR:"))
    events.count(path, events.DRAIN, "SR: health: again")
    events.gate_results(path, "prolog", {"gpu": "fail", "xid": "ok"}, now=5.0)
    events.gate_results(path, "epilog", {"gpu": "ok"}, now=6.0)
    doc = events.read(path)
    assert doc["counters"] == {"drain|health": 1, "drain|hang": 1, "drain|hang_suspect": 1,
                               "drain|sr__health__again": 1, "gate|gpu:fail": 1,
                               "gate|xid:ok": 1, "gate|gpu:ok": 1}
    assert doc["gate"]["gpu"] == {"result": "ok", "kind": "epilog", "at": 6.0}
    assert doc["gate"]["xid"]["result"] == "ok"


def test_events_are_bounded_and_an_unwritable_place_never_raises(tmp_path: Path) -> None:
    path = str(tmp_path / events.FILENAME)
    for i in range(events.MAX_KEYS + 20):
        events.count(path, events.DRAIN, f"cause{i}")
    assert len(events.read(path)["counters"]) == events.MAX_KEYS
    blocker = tmp_path / "file"
    blocker.write_text("")
    events.count(str(blocker / "x" / events.FILENAME), events.DRAIN, "health")  # logged only


def test_the_adapter_counts_what_it_does(tmp_path: Path) -> None:
    """drain/resume/requeue/hold through a real adapter on a stand-in scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "reason"
    state.write_text("")
    scontrol = bin_dir / "scontrol"
    # Just enough of scontrol: show node prints the reason last set, update records it.
    scontrol.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then echo "slurm 22.05.8"; exit 0; fi
if [ "$1" = show ]; then
  r=$(cat {state})
  if [ -n "$r" ]; then st=IDLE+DRAIN; else st=IDLE; fi
  echo "NodeName=$3 State=$st Reason=$r"
  exit 0
fi
for a in "$@"; do case "$a" in
  Reason=*) printf %s "${{a#Reason=}}" > {state};;
  State=RESUME) : > {state};;
esac; done
""")
    scontrol.chmod(0o755)
    adapter = SlurmAdapter(bin_dir=str(bin_dir))
    adapter.events_path = str(tmp_path / events.FILENAME)
    adapter.drain("n1", "nccl: busbw 10 GB/s < 40")
    adapter.resume("n1")
    adapter.requeue(7)
    doc = events.read(adapter.events_path)
    assert doc["counters"] == {"drain|nccl": 1, "resume|nccl": 1, "requeue|hang": 1}


def test_a_drain_counts_a_node_going_into_our_drain_not_each_call(tmp_path: Path) -> None:
    """Draining a node already in our drain (each health-check pass, another reason of ours)
    changes the reason without a count; after a resume the next drain counts again; a
    requeue-hold the plan releases counts as a requeue, one it leaves held as a hold."""
    from slurm_resilience.hang import actions
    from slurm_resilience.hang.actions import Clocked, Step, StepKind

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "reason"
    state.write_text("")
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then echo "slurm 22.05.8"; exit 0; fi
if [ "$1 $2" = "show node" ]; then
  r=$(cat {state})
  if [ -n "$r" ]; then st=IDLE+DRAIN; else st=IDLE; fi
  echo "NodeName=$3 State=$st Reason=$r"
  exit 0
fi
if [ "$1 $2" = "show job" ]; then
  echo "JobId=$3 JobName=t UserId=alice(1000) JobState=RUNNING Restarts=0 NodeList=n1"
  exit 0
fi
for a in "$@"; do case "$a" in
  Reason=*) printf %s "${{a#Reason=}}" > {state};;
  State=RESUME) : > {state};;
esac; done
""")
    scontrol.chmod(0o755)
    adapter = SlurmAdapter(bin_dir=str(bin_dir))
    adapter.events_path = str(tmp_path / events.FILENAME)
    for _ in range(5):  # HealthCheckProgram passes on a node that stays bad
        adapter.drain("n1", "health: gpu3 XID 79")
    adapter.drain("n1", "nccl: busbw 10 GB/s < 40")  # ours already: a new reason, no count
    assert events.read(adapter.events_path)["counters"] == {"drain|health": 1}
    assert adapter.resume("n1")
    adapter.drain("n1", "health: gpu3 XID 79")
    clock = Clocked(FakeClock(wall=0.0), lambda s: None)
    requeue = (Step(StepKind.REQUEUE_HOLD, text="c"), Step(StepKind.EXCLUDE, nodes=("n2",)),
               Step(StepKind.RELEASE))
    actions.execute(adapter, 7, 0, requeue, 0, 60.0, clock, lambda i: None)
    actions.execute(adapter, 8, 0, requeue[:2], 0, 60.0, clock, lambda i: None)
    assert events.read(adapter.events_path)["counters"] == {
        "drain|health": 2, "resume|nccl": 1, "requeue|hang": 1, "hold|hang": 1}


class _RacingScontrol:
    """scontrol for one node whose first ``show node`` waits (up to 2 s) until a second
    caller has asked too: without a lock both see the node in service."""

    def __init__(self) -> None:
        self.reason = ""
        self.shows = 0
        self.second_asked = threading.Event()
        self.lock = threading.Lock()

    def run(self, argv: Any, *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Any:
        from slurm_resilience.proc import Completed

        args = list(argv)[1:]
        out = ""
        if args[:2] == ["show", "node"]:
            with self.lock:
                self.shows += 1
                first = self.shows == 1
                seen = self.reason
            if first:
                self.second_asked.wait(2.0)
            else:
                self.second_asked.set()
            state = "IDLE+DRAIN" if seen else "IDLE"
            out = f"NodeName={args[2]} State={state} Reason={seen}\n"
        for a in args:
            if a.startswith("Reason="):
                with self.lock:
                    self.reason = a[len("Reason="):]
        return Completed(tuple(argv), 0, out, "", 0.0)


def test_two_hooks_draining_one_node_at_once_count_one_drain(tmp_path: Path) -> None:
    """A prolog and a HealthCheckProgram pass that find the same Xid at the same moment:
    the node goes into drain once, so it is counted once (the node's hooks and agent
    serialise read-then-drain under one lock beside the events file)."""
    fake = _RacingScontrol()
    path = str(tmp_path / events.FILENAME)

    def drain() -> None:
        adapter = SlurmAdapter(runner=fake, slurm_version=(22, 5))
        adapter.events_path = path
        adapter.drain("n1", "health: gpu3 XID 79")

    threads = [threading.Thread(target=drain) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.shows == 2
    assert events.read(path)["counters"] == {"drain|health": 1}


# -- the collector ------------------------------------------------------------------------------

@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    cfg = load_text(Config, f"agent: {{socket: {tmp_path}/run/agent.sock}}\n", "test")
    ctx = AgentContext(cfg=cfg, node="n1", adapter=SlurmAdapter())
    return Agent(ctx, [])


def collector_for(tmp_path: Path, agent: Agent | None = None
                  ) -> tuple[CollectorRegistry, Watcher, StepWatch, AgentSources]:
    watcher = Watcher()
    watch = StepWatch(lambda: Config().stragglers, "n1",
                      StragglerRecord(str(tmp_path / "stragglers.json")), FakeClock(wall=1e6))
    sources = AgentSources(node="n1", events_path=str(tmp_path / events.FILENAME),
                           nccl_path=str(tmp_path / nccl_cache.FILENAME), watcher=watcher,
                           uploader=Uploads({42: journal_record(42)}),
                           stragglers=Stragglers(watch),
                           agent=agent, services=("checkpoint", "heartbeat", "metrics"))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(sources))
    return registry, watcher, watch, sources


def test_every_family_from_the_agent_state_and_promtool_is_clean(tmp_path: Path,
                                                                   agent: Agent) -> None:
    registry, watcher, watch, sources = collector_for(tmp_path, agent)
    events.count(sources.events_path, events.DRAIN, "health")
    events.count(sources.events_path, events.INCIDENT, "requeue")
    events.count(sources.events_path, events.REQUEUE, "hang")
    events.count(sources.events_path, events.HOLD, "hang")
    events.gate_results(sources.events_path, "prolog", {"gpu": "fail", "xid": "ok"}, now=7.0)
    events.observe_drain(sources.events_path, "n1", "health", 5.0)
    events.observe_drain(sources.events_path, "n1", "health", 9.0)  # still the first sighting
    nccl_cache.store(sources.nccl_path, {
        "verdict": "pass", "finished_at": 99.0, "variants": [
            {"variant": "nvlink", "verdict": "pass",
             "busbw_gbps": {"1048576": 10.0, "268435456": 150.5}, "expected_gbps": 120.0},
            {"variant": "nvls", "verdict": "fail", "busbw_gbps": {}, "expected_gbps": None}]},
        boot="b")
    agent.tick_failures["heartbeat"] = 2
    feed(watcher, watch, 7, 120, slow_rank=5)
    release = threading.Event()
    watcher.threads[7] = threading.Thread(target=release.wait, daemon=True)  # an incident
    watcher.threads[7].start()
    try:
        text = generate_latest(registry).decode()
    finally:
        release.set()
    promtool_check(text)
    got = samples(text)
    P = "slurm_resilience_"
    want = {
        (P + "node_drains_total", (("cause", "health"),)): 1,
        (P + "hang_incidents_total", (("decision", "requeue"),)): 1,
        (P + "job_requeues_total", (("cause", "hang"),)): 1,
        (P + "job_holds_total", (("cause", "hang"),)): 1,
        (P + "gate_check_results_total", (("check", "gpu"), ("result", "fail"))): 1,
        (P + "gate_check_last_result", (("check", "gpu"), ("result", "fail"))): 1,
        (P + "gate_check_last_result", (("check", "gpu"), ("result", "ok"))): 0,
        (P + "gate_check_last_run_timestamp_seconds", (("check", "xid"),)): 7.0,
        (P + "node_our_drain_since_timestamp_seconds", (("cause", "health"),)): 5.0,
        (P + "nccl_bus_bandwidth_bytes_per_second", (("variant", "nvlink"),)): 150.5e9,
        (P + "nccl_bus_bandwidth_threshold_bytes_per_second", (("variant", "nvlink"),)): 120e9,
        (P + "nccl_test_passed", (("variant", "all"),)): 1,
        (P + "nccl_test_passed", (("variant", "nvlink"),)): 1,
        (P + "nccl_test_passed", (("variant", "nvls"),)): 0,
        (P + "jobs_watched", ()): 1,
        (P + "job_ranks", (("job_id", "7"),)): 8,
        (P + "job_straggler_ranks", (("job_id", "7"),)): 1,
        (P + "job_hang_incident_open", (("job_id", "7"),)): 1,
        (P + "job_step_time_samples", (("job_id", "7"),)): 800,
        (P + "node_straggler_recent_jobs", ()): 1,
        (P + "checkpoint_upload_backlog_steps", (("job_id", "42"),)): 2,
        (P + "checkpoint_upload_backlog_bytes", (("job_id", "42"),)): 6 << 20,
        (P + "checkpoint_upload_failed_steps", (("job_id", "42"),)): 1,
        (P + "checkpoint_commit_latency_seconds", (("job_id", "42"),)): 12.5,
        (P + "checkpoint_stagein_duration_seconds", (("job_id", "42"),)): 4.5,
        (P + "checkpoint_stagein_bytes", (("job_id", "42"),)): 3 << 20,
        (P + "agent_service_tick_failures_total", (("service", "heartbeat"),)): 2,
        (P + "agent_collect_errors", (("source", "nccl"),)): 0,
        (P + "agent_info", (("node", "n1"), ("version", "0.1.0"))): 1,
    }
    assert {k: got.get(k) for k in want} == want
    p50 = got[(P + "job_step_time_p50_seconds", (("job_id", "7"),))]
    p95 = got[(P + "job_step_time_p95_seconds", (("job_id", "7"),))]
    assert 0.9 < p50 < 1.1 < p95


def test_every_known_label_value_of_a_counter_starts_at_zero(tmp_path: Path) -> None:
    """Before any event, each counter family has a 0 series for every cause, decision and
    gate check/result it can count, so increase() sees the first event."""
    registry, _, _, sources = collector_for(tmp_path)
    got = samples(generate_latest(registry).decode())
    P = "slurm_resilience_"
    for kind, (name, _, label) in EVENT_FAMILIES.items():
        for cause in events.KNOWN_CAUSES[kind]:
            assert got.get((f"{P}{name}_total", ((label, cause),))) == 0, (name, cause)
    for check in events.KNOWN_CAUSES[events.GATE]:
        for result in GATE_RESULTS:
            key = (P + "gate_check_results_total", (("check", check), ("result", result)))
            assert got.get(key) == 0, key
    events.count(sources.events_path, events.DRAIN, "nccl")
    events.gate_results(sources.events_path, "prolog", {"newcheck": "warn"}, now=1.0)
    got = samples(generate_latest(registry).decode())
    assert got[(P + "node_drains_total", (("cause", "nccl"),))] == 1
    assert got[(P + "node_drains_total", (("cause", "health"),))] == 0
    assert got[(P + "gate_check_results_total", (("check", "newcheck"), ("result", "fail")))] == 0


def test_the_known_label_values_are_the_ones_the_suite_counts() -> None:
    """The causes kept beside the events file name the gate's checks, the hang decisions
    that are counted and the owners of the hooks' steps."""
    from slurm_resilience.hang import steps as heartbeat_steps
    from slurm_resilience.hang.incidentrecords import Action
    from slurm_resilience.health import gate
    from slurm_resilience.health import steps as health_steps
    from slurm_resilience.nccl import steps as nccl_steps

    assert events.KNOWN_CAUSES[events.GATE] == gate.CHECKS
    assert set(events.KNOWN_CAUSES[events.INCIDENT]) == {a.value for a in Action} - {"skip"}
    assert {health_steps.STEP, nccl_steps.STEP, heartbeat_steps.STEP, "checkpoint", "hooks",
            "hang", "hang_suspect", "other"} == set(events.DRAIN_CAUSES)


def test_per_job_series_end_with_the_job(tmp_path: Path) -> None:
    registry, watcher, watch, sources = collector_for(tmp_path)
    sources.uploader = None
    feed(watcher, watch, 7, 60)
    assert 'job_id="7"' in generate_latest(registry).decode()
    with watcher.lock:
        watcher.jobs.clear()
    watch.observe([])
    text = generate_latest(registry).decode()
    assert "job_id=" not in text
    promtool_check(text)


def test_a_failing_source_is_counted_and_the_rest_still_served(tmp_path: Path) -> None:
    registry, _, _, sources = collector_for(tmp_path)
    Path(sources.nccl_path).write_text("{not json")
    got = samples(generate_latest(registry).decode())
    assert got[("slurm_resilience_agent_collect_errors", (("source", "nccl"),))] == 1
    assert got[("slurm_resilience_checkpoint_upload_backlog_steps", (("job_id", "42"),))] == 2


# -- serving ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_http_endpoint_and_atomic_textfile(tmp_path: Path) -> None:
    port = free_port()
    textfile = tmp_path / "textfile" / "slurm_resilience_{node}.prom"
    textfile.parent.mkdir()
    cfg = load_text(Config, json.dumps({
        "node": {"state_dir": str(tmp_path / "state")},
        "metrics": {"port": 1, "ports": {"n1": port}, "textfile": str(textfile)}}), "test")
    svc = MetricsService(cfg, "n1", SlurmAdapter(), {})
    try:
        assert svc.url == f"http://127.0.0.1:{port}/metrics" and not svc.serve_error
        with urllib.request.urlopen(svc.url, timeout=30) as resp:
            served = resp.read().decode()
        assert "slurm_resilience_agent_info" in served
        promtool_check(served)
        svc.tick()
        written = (tmp_path / "textfile" / "slurm_resilience_n1.prom").read_text()
        assert "slurm_resilience_agent_start_time_seconds" in written
        assert os.listdir(textfile.parent) == ["slurm_resilience_n1.prom"]  # no temp left
        # A port in use: the service says why and the agent goes on.
        other = MetricsService(cfg, "n1", SlurmAdapter(), {})
        assert other.url == "" and f":{port}" in other.serve_error
        assert svc.handle_stragglers({}, None)["url"] == svc.url  # type: ignore[arg-type]
    finally:
        svc.close()


def test_textfile_write_never_leaves_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "m.prom"
    target.write_text("old\n")
    registry = CollectorRegistry()

    class Boom:
        def collect(self) -> Any:
            raise RuntimeError("collector broke")

    registry.register(Boom())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        write_textfile(str(target), registry)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["m.prom"]


def test_the_prolog_never_imports_prometheus_client() -> None:
    script = """
import importlib, json, sys
from slurm_resilience.hooks import steps
for spec in steps.PROLOG + steps.EPILOG + steps.HEALTHCHECK:
    importlib.import_module(spec.partition(":")[0])
import slurm_resilience.events
print(json.dumps("prometheus_client" in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


def test_goodput_ratio_and_losses_per_running_job(tmp_path: Path) -> None:
    from slurm_resilience.goodput.ledger import Ledger

    registry, _, _, sources = collector_for(tmp_path)
    ledger = Ledger(str(tmp_path / "goodput"))
    sources.goodput = Goodput(ledger)
    # First step at 10, 30 steps of 1 s since: productive 30 s of 40 (from step times).
    v = view(5, [slot(r, 31, 1.0, 5) for r in range(2)])
    object.__setattr__(v.record, "started", 0.0)
    for s in v.slots:
        object.__setattr__(s, "last_beat", 40.0)
        object.__setattr__(s, "created", 9.0)
    ledger.observe([v], 40.0)
    text = generate_latest(registry).decode()
    promtool_check(text)
    got = samples(text)
    assert got[("slurm_resilience_job_goodput_ratio", (("job_id", "5"),))] == 0.75
    assert got[("slurm_resilience_job_goodput_lost_seconds",
                (("job_id", "5"), ("kind", "before_first_step")))] == 10.0
    assert got[("slurm_resilience_job_goodput_lost_seconds",
                (("job_id", "5"), ("kind", "unexplained")))] == 0.0
    ledger.observe([], 41.0)
    assert "job_goodput_ratio{" not in generate_latest(registry).decode()


def test_an_unreachable_checkpoint_agent_shows_in_the_metrics(tmp_path: Path) -> None:
    """A hook that found this node's agent unreachable is counted by hook, and a job whose
    ranks couldn't reach other nodes' agents shows how many per job."""
    registry, _, _, sources = collector_for(tmp_path)
    events.count(sources.events_path, events.CKPT_AGENT, "prolog")
    events.count(sources.events_path, events.CKPT_AGENT, "epilog")
    sources.uploader.jobs[42]["unreachable_nodes"] = ["n2", "n3"]
    text = generate_latest(registry).decode()
    promtool_check(text)
    got = samples(text)
    P = "slurm_resilience_"
    assert got[(P + "checkpoint_agent_unreachable_total", (("hook", "prolog"),))] == 1
    assert got[(P + "checkpoint_agent_unreachable_total", (("hook", "epilog"),))] == 1
    assert got[(P + "checkpoint_unreachable_agent_nodes", (("job_id", "42"),))] == 2


def test_the_checkpoint_hooks_count_the_event_kind_metrics_knows() -> None:
    """uploader.steps names metrics' CKPT_AGENT without importing metrics (no cycle)."""
    from slurm_resilience import events
    from slurm_resilience.uploader import steps

    assert steps.CKPT_AGENT_UNREACHABLE == events.CKPT_AGENT
