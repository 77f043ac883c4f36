"""Suite-wide observe mode: every decision is made and recorded, and nothing is carried out
(no drain, resume, requeue, hold, cancel or exclusion; a prolog never fails a job)."""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from slurm_resilience.config import Config, load_text
from slurm_resilience.hang import status as st
from slurm_resilience.hooks import runner
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.metrics import cluster, observe
from slurm_resilience.slurm import observed
from slurm_resilience.slurm.adapter import SlurmAdapter, from_config
from slurm_resilience.testing import FakeClock, FakeRunner, completed

IDLE = "NodeName=node7 CPUAlloc=0 CPUTot=2 State=IDLE Partitions=debug Reason=(null)"
DRAINED = ("NodeName=node7 CPUAlloc=0 CPUTot=2 State=IDLE+DRAIN Partitions=debug "
           "Reason=SR: health: gpu3 XID 79")
JOB = ("JobId=12 JobName=t UserId=bob(1000) JobState=RUNNING Reason=None Restarts=0 "
       "NodeList=node7 ExcNodeList=(null) Partition=debug")


def observing(tmp_path: Path, answers: dict[str, list[object]]) -> tuple[SlurmAdapter,
                                                                           FakeRunner]:
    fake = FakeRunner(answers)  # type: ignore[arg-type]
    ctl = SlurmAdapter(runner=fake, observe=True)
    ctl.events_path = str(tmp_path / "metrics-events.json")
    return ctl, fake


def test_observe_config_reaches_the_adapter() -> None:
    """`mode: observe` builds an observing adapter; hang handling keeps deciding as it would."""
    cfg = load_text(Config, "mode: observe\nheartbeat:\n  mode: act\n")
    assert from_config(cfg).observe and cfg.heartbeat.mode == "act"
    assert not from_config(Config()).observe


def test_a_hang_plan_under_observe_is_recorded_step_by_step_and_not_run(tmp_path: Path
                                                                        ) -> None:
    """Hang handling's plan (drain a blamed node, hold, exclude, release) runs through the
    observing adapter: each step says it was not carried out, each decision is recorded,
    and Slurm is only read."""
    from slurm_resilience.hang import actions
    from slurm_resilience.hang.actions import Step, StepKind

    ctl, fake = observing(tmp_path, {"scontrol": [
        lambda argv: completed(IDLE if argv[2] == "node" else JOB)]})
    plan = (Step(StepKind.DRAIN, "node7", "hang job 12: node7 blamed"),
            Step(StepKind.REQUEUE_HOLD, text="SR: hang job 12"),
            Step(StepKind.EXCLUDE, nodes=("node7",)), Step(StepKind.RELEASE))
    done, complete = actions.execute(ctl, 12, 0, plan, 0, 1e12,
                                     actions.Clocked(FakeClock(wall=0.0), lambda s: None),
                                     lambda i: None)
    assert complete and all(a.startswith("not carried out (mode observe): ") for a in done)
    assert all(c[1] == "show" for c in fake.calls), fake.calls
    lines = [observed.line(d) for d in
             observed.read(str(tmp_path / observed.FILENAME))["decisions"]]
    assert lines == ["would drain node7: SR: hang job 12: node7 blamed",
                         "would hold job 12: SR: hang job 12",
                         "would exclude job 12: ExcNodeList=node7"]


def test_observe_decides_a_drain_records_it_once_and_calls_no_update(tmp_path: Path) -> None:
    """A drain is decided (the node re-read, a foreign drain still refused) and recorded; the
    same decision again is one decision seen twice; no `scontrol update` is run."""
    ctl, fake = observing(tmp_path, {"scontrol": [completed(IDLE)]})
    assert ctl.drain("node7", "health: gpu3 XID 79") == "SR: health: gpu3 XID 79"
    ctl.drain("node7", "health: gpu3 XID 79")
    assert [c[1] for c in fake.calls] == ["show", "show"]
    doc = observed.read(str(tmp_path / observed.FILENAME))
    assert doc["counts"] == {"drain": 1}
    (d,) = doc["decisions"]
    assert observed.line(d) == "would drain node7: SR: health: gpu3 XID 79" and d["times"] == 2


def test_observe_acts_on_no_job_and_resumes_no_node(tmp_path: Path) -> None:
    """Requeue, hold, cancel, release, exclusion and resume are each recorded, never run."""
    ctl, fake = observing(tmp_path, {"scontrol": [completed(DRAINED)]})
    ctl.requeue(12)
    ctl.requeue_hold(12, "hang job 12")
    ctl.cancel(12)
    ctl.release(12)
    ctl.set_excluded_nodes(12, ["node7"])
    assert ctl.resume("node7") is False
    assert all(c[1] == "show" for c in fake.calls), fake.calls
    lines = [observed.line(d) for d in
             observed.read(str(tmp_path / observed.FILENAME))["decisions"]]
    assert lines == ["would requeue job 12: requeue", "would hold job 12: hang job 12",
                     "would cancel job 12: cancel", "would release job 12: release",
                     "would exclude job 12: ExcNodeList=node7",
                     "would resume node7: drained with 'SR: health: gpu3 XID 79'"]


@pytest.fixture
def sick_step() -> Iterator[None]:
    mod = types.ModuleType("sr_observe_steps")

    def sick(ctx: HookContext) -> list[Problem]:
        return [Problem("health", "gpu3 XID 79 (GPU fell off the bus)")]

    mod.sick = sick  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield
    del sys.modules[mod.__name__]


def test_observe_prolog_lets_the_job_run_and_records_the_drain(
        sick_step: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prolog that finds a sick node in observe mode exits 0 (no requeue) and leaves
    "would drain" in the node's decisions and in its log."""
    monkeypatch.setitem(runner.STEPS, "prolog", ["sr_observe_steps:sick"])
    fake = FakeRunner({"scontrol": [completed(IDLE)]})
    monkeypatch.setattr("slurm_resilience.slurm.adapter.Runner", lambda: fake)
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(f"mode: observe\nlogging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n"
                       f"node:\n  state_dir: {tmp_path}/state\n")
    env = {"SLURM_RESILIENCE_CONFIG": str(cfgfile), "SLURMD_NODENAME": "node7",
           "SLURM_JOB_ID": "12"}
    assert runner.main("prolog", [], env) == 0
    assert [c[1] for c in fake.calls] == ["show"]
    (d,) = observed.read(str(tmp_path / "state" / observed.FILENAME))["decisions"]
    assert observed.line(d) == ("would drain node7: SR: health: gpu3 XID 79 (GPU fell off "
                                "the bus)")
    events = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert any(e["event"].startswith("observe: would drain node7: SR: health: gpu3 XID 79")
               for e in events)


def test_status_metrics_and_cluster_view_say_what_would_have_been_done(tmp_path: Path
                                                                       ) -> None:
    """`status` lists each decision, the agent's metrics count and name them, and
    `status --cluster` shows them per node with the nodes whose config fails."""
    path = str(tmp_path / observed.FILENAME)
    observed.record(path, "drain", "node7", "SR: health: gpu3 XID 79", now=100.0)
    observed.record(path, "drain", "node7", "SR: health: gpu3 XID 79", now=160.0)
    doc = observed.read(path)
    text = st.render({"mode": "observe", "suite_mode": "observe",
                      "observed": doc["decisions"]})
    assert "mode observe: acting on nothing; 1 decision(s) not carried out:" in text
    assert "  would drain node7: SR: health: gpu3 XID 79 (at " in text and "2 times" in text

    class Source(Collector):
        def collect(self) -> Iterator[Metric]:
            return observe.metrics(str(tmp_path / "metrics-events.json"), "observe")

    registry = CollectorRegistry()
    registry.register(Source())
    scraped = cluster.parse(generate_latest(registry).decode())
    assert ("slurm_resilience_observed_decisions_total", {"action": "drain"}, 1.0) in scraped
    assert ("slurm_resilience_observed_decisions_total", {"action": "requeue"}, 0.0) in scraped
    assert ("slurm_resilience_observe_mode", {}, 1.0) in scraped
    scraped.append(("slurm_resilience_config_valid", {}, 0.0))
    view = cluster.assemble([], [], [cluster.Scrape("node7", "u", scraped)], "SR:",
                            Config().stragglers)
    assert view.observed == ["node7: would drain node7: SR: health: gpu3 XID 79"]
    assert view.config_invalid == ["node7"]
    rendered = cluster.render(view)
    assert "  node7: would drain node7: SR: health: gpu3 XID 79" in rendered


def test_the_agents_adapter_follows_mode_as_the_file_changes(tmp_path: Path) -> None:
    """The agent's one adapter switches observe ⇄ enforce at its next tick after the file
    changes, without a restart."""
    from slurm_resilience.config import load
    from slurm_resilience.hang.watcher import HangWatcher

    cfgfile = tmp_path / "c.yaml"
    body = (f"node:\n  state_dir: {tmp_path}/state\n  run_dir: {tmp_path}/run\n"
            "  job_tmpfs:\n    enabled: false\nheartbeat:\n  rendezvous: none\n")
    cfgfile.write_text("mode: observe\n" + body)
    adapter = from_config(load(str(cfgfile)))
    watcher = HangWatcher(load(str(cfgfile)), "node7", adapter, config_path=str(cfgfile))
    watcher.tick()
    assert adapter.observe
    cfgfile.write_text("mode: enforce\n" + body)
    os.utime(cfgfile, (1, 1))  # a new mtime, whatever the filesystem's resolution
    watcher.tick()
    assert not adapter.observe
    watcher.close()
