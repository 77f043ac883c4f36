"""Every metric an agent exports, with every source populated: what the dashboard and the
alert rules may name (test_grafana_dashboard, test_prometheus_rules)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from agent_state import Goodput, Stragglers, Uploads, Watcher, feed, journal_record
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from slurm_resilience import events
from slurm_resilience.agent.daemon import Agent
from slurm_resilience.agent.service import AgentContext, Peer
from slurm_resilience.config import Config, load_text
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.goodput.saves import SaveBook
from slurm_resilience.metrics.collector import AgentCollector, AgentSources
from slurm_resilience.nccl import cache as nccl_cache
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.nodes import Verdict
from slurm_resilience.stragglers.record import StragglerRecord
from slurm_resilience.testing import FakeClock

NAME = re.compile(r"\bslurm_resilience_[a-z0-9_]+")


def exported(tmp_path: Path) -> set[str]:
    """Every sample name an agent with every source populated exports."""
    cfg = load_text(Config, f"agent: {{socket: {tmp_path}/run/agent.sock}}\n", "test")
    agent = Agent(AgentContext(cfg=cfg, node="n1", adapter=SlurmAdapter()), [])
    ev = str(tmp_path / events.FILENAME)
    for kind in events.KINDS:
        events.count(ev, kind, "x")
    events.gate_results(ev, "prolog", {"gpu": "fail"})
    events.observe_drain(ev, "n1", "health", 1.0)
    nccl = str(tmp_path / nccl_cache.FILENAME)
    nccl_cache.store(nccl, {"verdict": "pass", "variants": [
        {"variant": "nvlink", "busbw_gbps": {"1": 1.0}, "expected_gbps": 1.0}]}, boot="b")
    watcher = Watcher()
    watch = StepWatch(lambda: cfg.stragglers, "n1", StragglerRecord(str(tmp_path / "s.json")),
                      FakeClock(wall=1e6))
    feed(watcher, watch, 7, 80, slow_rank=1)  # type: ignore[arg-type]
    watch.named_node[7] = Verdict(7, "n1", "n0", 1.3, 1.0)  # named by the job's judge
    ledger = Ledger(str(tmp_path / "goodput"))
    ledger.observe(list(watcher.jobs.values()), 1e9)  # type: ignore[arg-type]
    saves = SaveBook()
    saves.report({"job_id": 7, "run": 0, "step": 5, "stall_s": 0.1, "write_s": 1.0},
                 Peer(pid=1, uid=0, gid=0), 0)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(AgentSources(
        node="n1", events_path=ev, nccl_path=nccl, watcher=watcher,
        uploader=Uploads({42: journal_record(42)}), stragglers=Stragglers(watch),
        goodput=Goodput(ledger, saves),
        agent=agent, services=("heartbeat",))))
    release = threading.Event()
    watcher.threads[7] = threading.Thread(target=release.wait, daemon=True)  # an incident
    watcher.threads[7].start()
    try:
        text = generate_latest(reg).decode()
    finally:
        release.set()
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {s.name for s in fam.samples}
    return names
