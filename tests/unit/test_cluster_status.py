"""`status --cluster`: the view assembled from agents' metrics and Slurm's records, and the
scrape of real endpoints (one of them unreachable)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from agent_state import slot, view
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from slurm_resilience.config import Config
from slurm_resilience.metrics import cluster, events
from slurm_resilience.metrics.collector import AgentCollector, AgentSources
from slurm_resilience.slurm.parse import JobInfo, NodeInfo
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.nodes import Verdict
from slurm_resilience.stragglers.record import StragglerRecord
from slurm_resilience.stragglers.synthetic import steps

CFG = Config()


class Watcher:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[int, object] = {}
        self.threads: dict[int, threading.Thread] = {}


def agent_registry(tmp_path: Path, node: str, slowdown: float) -> CollectorRegistry:
    """One node's agent with job 21 (2 ranks here) running at its own speed; a slowed node
    was named by the job's judging agent (n1), as it tells the named node's agent."""
    watcher = Watcher()
    watch = StepWatch(lambda: CFG.stragglers, node,
                      StragglerRecord(str(tmp_path / f"{node}-s.json")), lambda: 1e6)
    for i, row in enumerate(steps(2, 120, int(node[1:]))):
        v = view(21, [slot(r, i + 1, x * (1 + slowdown), 21) for r, x in enumerate(row)])
        watcher.jobs[21] = v
        watch.observe([v])
    if slowdown:
        mine = watch.snapshot()[0].p50_s
        watch.node_named(Verdict(21, node, "n1", mine, mine / (1 + slowdown)))
    sources = AgentSources(node=node, events_path=str(tmp_path / f"{node}-ev.json"),
                           nccl_path="", watcher=watcher, steps=watch)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(sources))
    return reg


def test_the_view_names_drains_suspects_held_jobs_and_the_slow_node(tmp_path: Path) -> None:
    scrapes = [cluster.Scrape(n, f"http://x/{n}", cluster.parse(
        generate_latest(agent_registry(tmp_path, n, 0.3 if n == "n4" else 0.0)).decode()))
        for n in ("n1", "n2", "n3", "n4")]
    scrapes.append(cluster.Scrape("n5", "http://x/n5", error="URLError: refused"))
    nodes = [
        NodeInfo("n1", "IDLE", frozenset({"DRAIN"}), reason="SR: health: gpu3 XID 79"),
        NodeInfo("n2", "IDLE", frozenset({"DRAIN"}), reason="SR: suspect hang job 7 user bob "
                 "at 2026-01-01T00:00:00Z: stalled first; verifying"),
        NodeInfo("n3", "IDLE", frozenset({"DRAIN"}), reason="maintenance"),
        NodeInfo("n4", "ALLOCATED", frozenset()),
    ]
    jobs = [JobInfo(9, "train", "bob", 1001, "PENDING", reason="job requeued in held state",
                    admin_comment="SR: [sr-hang n=2 ckpt=100 restart=2] hang"),
            JobInfo(21, "train", "alice", 1000, "RUNNING")]
    view_ = cluster.assemble(nodes, jobs, scrapes, "SR:", CFG.stragglers)
    assert [d.node for d in view_.drained] == ["n1"]
    assert [d.node for d in view_.suspects] == ["n2"]
    assert [j.job_id for j in view_.held_jobs] == [9]
    assert [s.node for s in view_.straggler_nodes] == ["n4"]
    assert view_.straggler_nodes[0].slowdown == 0.3
    assert [r.node for r in view_.recurring_stragglers] == ["n4"]
    assert (view_.agents_scraped, view_.agents_total) == (4, 5)
    assert view_.errors == ["n5: couldn't read http://x/n5: URLError: refused"]
    assert view_.to_json()["drained"][0]["node"] == "n1"
    text = cluster.render(view_)
    assert "n4" in text and "could not check: n5" in text


def test_held_jobs_come_from_our_ledger_only() -> None:
    from slurm_resilience.heartbeat import requeue as R

    ledger = R.Ledger(requeues=2, ckpt_step=100, restart=2).token()
    jobs = [JobInfo(9, "t", "bob", 1001, "PENDING", reason="job requeued in held state",
                    admin_comment=ledger),
            JobInfo(10, "t", "bob", 1001, "PENDING", reason="held by user")]
    held = cluster.assemble([], jobs, [], "SR:", CFG.stragglers).held_jobs
    assert [j.job_id for j in held] == [9]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_scrape_all_reads_real_endpoints_and_lists_the_one_that_does_not_answer(
        tmp_path: Path) -> None:
    reg = agent_registry(tmp_path, "n1", 0.0)
    events.count(str(tmp_path / "n1-ev.json"), events.DRAIN, "health")
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        urls = {"n1": f"http://127.0.0.1:{server.server_port}/metrics",
                "n2": f"http://127.0.0.1:{free_port()}/metrics"}
        got = {s.node: s for s in cluster.scrape_all(urls, timeout=10)}
    finally:
        server.shutdown()
    assert not got["n1"].error and ("slurm_resilience_node_drains_total",
                                    {"cause": "health"}, 1.0) in got["n1"].samples
    assert got["n2"].error and not got["n2"].samples


def test_metrics_urls_use_each_nodes_port() -> None:
    from slurm_resilience.config import load_text

    cfg = load_text(Config, "metrics: {port: 9000, ports: {b: 9002}}\n", "t")
    assert cluster.metrics_urls(cfg, {"a": "10.0.0.1", "b": "10.0.0.2", "c": "fe80::1"}) == {
        "a": "http://10.0.0.1:9000/metrics", "b": "http://10.0.0.2:9002/metrics",
        "c": "http://[fe80::1]:9000/metrics"}
