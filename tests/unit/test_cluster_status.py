"""`status --cluster`: the view assembled from agents' metrics and Slurm's records, and the
scrape of real endpoints (one of them unreachable): drains, suspects, held jobs, the slow
node, open incidents, checkpoint backlog per node and the worst goodput among running
jobs."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from agent_state import Goodput, Stragglers, Uploads, Watcher, journal_record, slot, view
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from slurm_resilience import events
from slurm_resilience.config import Config
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.metrics import cluster
from slurm_resilience.metrics.collector import AgentCollector, AgentSources
from slurm_resilience.slurm.parse import JobInfo, NodeInfo
from slurm_resilience.stragglers.jobsteps import StepWatch
from slurm_resilience.stragglers.nodes import Verdict
from slurm_resilience.stragglers.record import StragglerRecord
from slurm_resilience.stragglers.synthetic import steps
from slurm_resilience.testing import FakeClock

CFG = Config()


def agent_registry(tmp_path: Path, node: str, slowdown: float) -> CollectorRegistry:
    """One node's agent with job 21 (2 ranks here) running at its own speed; a slowed node
    was named by the job's judging agent (n1), as it tells the named node's agent."""
    watcher = Watcher()
    watch = StepWatch(lambda: CFG.stragglers, node,
                      StragglerRecord(str(tmp_path / f"{node}-s.json")), FakeClock(wall=1e6))
    for i, row in enumerate(steps(2, 120, int(node[1:]))):
        v = view(21, [slot(r, i + 1, x * (1 + slowdown), 21) for r, x in enumerate(row)])
        watcher.jobs[21] = v
        watch.observe([v])
    if slowdown:
        mine = watch.snapshot()[0].p50_s
        watch.node_named(Verdict(21, node, "n1", mine, mine / (1 + slowdown)))
    sources = AgentSources(node=node, events_path=str(tmp_path / f"{node}-ev.json"),
                           nccl_path="", watcher=watcher, stragglers=Stragglers(watch))
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
    # Slow in one job of one user: a straggler node of that job, not a recurring straggler.
    assert view_.recurring_stragglers == []
    assert (view_.agents_scraped, view_.agents_total) == (4, 5)
    assert view_.errors == ["n5: couldn't read http://x/n5: URLError: refused"]
    assert view_.to_json()["drained"][0]["node"] == "n1"
    text = cluster.render(view_)
    assert "n4" in text and "could not check: n5" in text


def test_held_jobs_come_from_our_ledger_only() -> None:
    from slurm_resilience.hang import requeue as R

    ledger = R.Ledger(requeues=2, ckpt_step=100, restart=2).token()
    jobs = [JobInfo(9, "t", "bob", 1001, "PENDING", reason="job requeued in held state",
                    admin_comment=ledger),
            JobInfo(10, "t", "bob", 1001, "PENDING", reason="held by user")]
    held = cluster.assemble([], jobs, [], "SR:", CFG.stragglers).held_jobs
    assert [j.job_id for j in held] == [9]


def test_jobs_pending_with_our_exclusions_are_listed_and_stranded_ones_flagged() -> None:
    """status --cluster lists the jobs the suite requeued with nodes excluded, and says how
    to free one Slurm can never start so (BadConstraints)."""
    from slurm_resilience.hang import requeue as R

    ledger = R.Ledger(requeues=1, ckpt_step=10, restart=1).token()
    jobs = [JobInfo(11, "t", "bob", 1001, "PENDING", reason="Priority", admin_comment=ledger,
                    exc_nodes=("node2",)),
            JobInfo(12, "t", "amy", 1002, "PENDING", reason="BadConstraints",
                    admin_comment=ledger, exc_nodes=("node2",)),
            JobInfo(13, "t", "eve", 1003, "PENDING", reason="Priority", exc_nodes=("node2",))]
    view_ = cluster.assemble([], jobs, [], "SR:", CFG.stragglers)
    assert [(c.job_id, c.stranded) for c in view_.constrained_jobs] == [(11, False), (12, True)]
    text = cluster.render(view_)
    assert "job 12 (amy): excludes node2, pending (BadConstraints): it can never start so; " \
           "clear with scontrol update JobId=12 ExcNodeList=" in text
    assert "job 13" not in text


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


def busy_agent(tmp_path: Path, node: str, goodput: dict[int, int], incidents: list[int],
               backlog: list[int], stop: threading.Event) -> CollectorRegistry:
    """One node's agent: per job in ``goodput``, a run from 0 with its first step at
    40 - N and N steps of 1 s to 40 (goodput N/40); a hang incident being handled (a live
    handler thread) for each job in ``incidents``; and each job in ``backlog`` with two
    checkpoint steps not yet in S3 (6 MiB left), the others' steps all committed."""
    watcher = Watcher()
    for job in incidents:
        t = threading.Thread(target=stop.wait, daemon=True)
        t.start()
        watcher.threads[job] = t
    ledger = Ledger(str(tmp_path / node / "goodput"))
    views = []
    for job, n in goodput.items():
        v = view(job, [slot(r, n + 1, 1.0, job) for r in range(2)])
        object.__setattr__(v.record, "started", 0.0)
        for s in v.slots:
            object.__setattr__(s, "last_beat", 40.0)
        views.append(v)
    ledger.observe(views, 40.0)
    uploads = {}
    for job in goodput:
        rec = journal_record(job)
        if job not in backlog:
            rec["steps"] = {"100": rec["steps"]["100"]}  # committed in S3: nothing waits
        uploads[job] = rec
    sources = AgentSources(node=node, events_path=str(tmp_path / f"{node}-ev.json"),
                           nccl_path="", watcher=watcher, uploader=Uploads(uploads),
                           goodput=Goodput(ledger), stragglers=Stragglers(StepWatch(
                               lambda: CFG.stragglers, node,
                               StragglerRecord(str(tmp_path / f"{node}-s.json")),
                               FakeClock(wall=1e6))))
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(sources))
    return reg


def test_incidents_backlog_and_worst_goodput_from_real_endpoints(tmp_path: Path) -> None:
    """Three agents served over HTTP, scraped as `status --cluster` does. Job 31 runs on n1
    and n3 with a hang incident open on both, goodput 30/40 and 36/40; job 32 runs on n2
    with goodput 20/40, the worst of the running jobs; job 33 (n2, 4/40) is no longer
    running, so it is not the worst. n1 has job 31's two steps not yet in S3."""
    stop = threading.Event()
    agents = {"n1": busy_agent(tmp_path, "n1", {31: 30}, [31], [31], stop),
              "n2": busy_agent(tmp_path, "n2", {32: 20, 33: 4}, [], [], stop),
              "n3": busy_agent(tmp_path, "n3", {31: 36}, [31, -1], [], stop)}
    servers = {n: start_http_server(0, addr="127.0.0.1", registry=r)[0]
               for n, r in agents.items()}
    try:
        urls = {n: f"http://127.0.0.1:{srv.server_port}/metrics" for n, srv in servers.items()}
        scrapes = cluster.scrape_all(urls, timeout=10)
    finally:
        stop.set()
        for srv in servers.values():
            srv.shutdown()
    assert all(not s.error for s in scrapes), [s.error for s in scrapes]
    jobs = [JobInfo(31, "train", "alice", 1000, "RUNNING"),
            JobInfo(32, "train", "bob", 1001, "RUNNING"),
            JobInfo(33, "train", "bob", 1001, "COMPLETED")]
    view_ = cluster.assemble([], jobs, scrapes, "SR:", CFG.stragglers)

    # Open incidents: job 31 on both its nodes (n3's thread -1 is not a job's).
    assert view_.incidents == [cluster.OpenIncident(31, ("n1", "n3"))]
    # Backlog per node: only n1 has steps waiting (200 and 300: 10 MiB less 4 MiB sent).
    assert view_.checkpoint_backlog == [cluster.Backlog("n1", 6 << 20, {"31": 2})]
    # Worst goodput among running jobs: job 32 (job 33's lower ratio is not running; job
    # 31's is the lower of its two nodes).
    assert view_.worst_goodput == cluster.Goodput(32, 0.5)
    got = cluster.assemble([], jobs[:1], scrapes, "SR:", CFG.stragglers).worst_goodput
    assert got == cluster.Goodput(31, 0.75)
    assert cluster.assemble([], [], scrapes, "SR:", CFG.stragglers).worst_goodput is None

    text = cluster.render(view_)
    assert "job 31 on n1,n3" in text
    assert "worst goodput among running jobs: job 32 50.0% (slurm-resilience goodput 32)" \
        in text
    js = view_.to_json()
    assert js["incidents"] == [{"job_id": 31, "nodes": ("n1", "n3")}]
    assert js["checkpoint_backlog"][0]["node"] == "n1"
    assert js["worst_goodput"] == {"job_id": 32, "ratio": 0.5}


def test_nodes_suspected_by_several_users_jobs_are_reported_not_drained(tmp_path: Path) -> None:
    """A node whose agent counts suspicion from 3 users' jobs (verified and back in service)
    is listed for operators in `status --cluster`; one user's suspicion is not."""
    from agent_state import Suspects

    scrapes = []
    for node, users in (("n1", 3), ("n2", 1)):
        watcher = Watcher()
        watcher.suspects = Suspects(users)  # type: ignore[attr-defined]
        reg = CollectorRegistry(auto_describe=False)
        reg.register(AgentCollector(AgentSources(
            node=node, events_path=str(tmp_path / f"{node}-ev.json"), nccl_path="",
            watcher=watcher)))
        scrapes.append(cluster.Scrape(node, f"http://x/{node}",
                                      cluster.parse(generate_latest(reg).decode())))
    view = cluster.assemble([], [], scrapes, "SR:", CFG.stragglers)
    assert view.suspected_by_several == [cluster.Suspected("n1", 3)]
    assert view.drained == [] and view.suspects == []
    text = cluster.render(view)
    assert "suspected by several users' jobs (each verified: drained only on a failed check) " \
           "(1):\n  n1             jobs of 3 users" in text
