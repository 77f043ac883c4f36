"""Acceptance: a real Prometheus server (Debian's package) scrapes every sandbox agent.

After an injected Xid, a hang and a checkpointed job, PromQL against that server returns the
drain, incident, goodput and upload-backlog series. The job hung once and resumed; its
`goodput` over the nodes it ran on accounts for all its allocated time but the gap between
the steps' time on the job's clock and goodput's estimate of it (the kept steps times their
mean step time), within 3 s, and the losses match the
job's own printed clock (examples/train.py's ``at=`` stamps) and its hang report, to one
agent tick (heartbeat.interval_s = 0.5 s) plus the stamp's distance from the event:

* lost since checkpoint: from the checkpoint of step 10 to the hang before step 12, 1.0 s;
* hung before detection: from the printed hang to the report's detection time, 1.5 s;
* checkpoint stalls: the printed stall_ms of every save the runs kept, 1.0 s in all;
* stage-in + before the first step of run 1: at most the time from the hang's detection to
  run 1's "running" line (its allocation starts in between), and more than 0;
* productive: 28 kept steps (2..10, then 12..30) of 0.1 s sleep plus compute: at least
  2.8 s, at most the time the job's own clock shows it stepping (plus 1 s).

The allocation times come from the agents here (no accounting in this sandbox); the
accounting sandbox checks the rest against sacct's run times.

The same server loads conf/prometheus-rules.yml and then evaluates every expression of
conf/grafana-dashboard.json and every alert rule through its query API: one hang, one
requeue and one Xid drain (drained again by each HealthCheckProgram pass) each give an
increase of 1, and a stand-in target that stops answering is the one agent down.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from hang_jobs import (
    acting,
    clock_minus_productive_s,
    goodput,
    job_clock,
    output,
    reports,
    submit,
    wait_for,
    wait_for_decision,
)

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "conf" / "grafana-dashboard.json"
RULES = ROOT / "conf" / "prometheus-rules.yml"
GONE = "gone1"  # the stand-in agent that stops answering


class _GoneAgent(BaseHTTPRequestHandler):
    """Answers a scrape as an agent would, with only its agent_info (named GONE)."""

    def do_GET(self) -> None:
        body = (f'slurm_resilience_agent_info{{node="{GONE}",version="0"}} 1\n').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


@dataclass
class Prom:
    url: str
    gone: ThreadingHTTPServer
    gone_target: str
    started: float


@pytest.fixture
def prometheus(sandbox: Sandbox, tmp_path: Path) -> Iterator[Prom]:
    """A Prometheus server scraping every agent (and the stand-in that will stop) every
    second, evaluating the shipped rules as often; yields it."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: `make setup` installs Debian's prometheus package"
    gone = ThreadingHTTPServer(("127.0.0.1", 0), _GoneAgent)
    threading.Thread(target=gone.serve_forever, daemon=True).start()
    gone_target = f"127.0.0.1:{gone.server_address[1]}"
    targets = [f"127.0.0.1:{sandbox.layout.metrics_port(i)}"
               for i in range(1, len(sandbox.nodes) + 1)] + [gone_target]
    conf = tmp_path / "prometheus.yml"
    conf.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "slurm-resilience",
                            "static_configs": [{"targets": targets}]}]}))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={conf}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        # Each target answered a scrape in the last 10 s: on a loaded machine one scrape in a
        # few can pass the 1 s timeout, and all five at one instant may take long to line up.
        try:
            wait_for(lambda: len(query(url, 'max_over_time(up{job="slurm-resilience"}[10s])'
                                             ' == 1')) == len(targets),
                     60, "every agent scraped by Prometheus")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {_target_health(url)}") from None
        yield Prom(url, gone, gone_target, time.time())
    finally:
        gone.shutdown()
        gone.server_close()
        sandbox.update_resilience_config({})  # the NCCL test off again
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for node in sandbox.nodes:
            faults.heal(sandbox.state_dir, node)


def _target_health(base: str) -> list[str]:
    """Each scrape target's health and last error, as Prometheus reports them."""
    try:
        active = api(base, "targets")["activeTargets"]
    except (urllib.error.URLError, ValueError, AssertionError) as exc:
        return [f"targets unreadable: {exc}"]
    return [f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}".strip()
            for t in active]


def api(base: str, path: str, **params: str) -> Any:
    """Prometheus's answer to an API call; an error status fails the test with its message."""
    try:
        with urllib.request.urlopen(f"{base}/api/v1/{path}?" + urllib.parse.urlencode(params),
                                    timeout=10) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus's error
        answer = json.loads(exc.read())
    assert answer["status"] == "success", (params, answer)
    return answer["data"]


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """The query's result; [] while the server can't answer yet (a Prometheus still
    starting answers 503 with a text body, not JSON)."""
    try:
        return list(api(base, "query", query=promql)["result"])
    except (urllib.error.URLError, ValueError):
        return []


J = "* on (instance, job) group_left (node) slurm_resilience_agent_info"


def series(r: dict[str, Any]) -> str:
    """A result's labels, short: what the report lists."""
    return ",".join(f"{k}={v}" for k, v in sorted(r["metric"].items())
                    if k not in ("job", "instance", "__name__")) or "-"


def instant(prom: Prom, expr: str) -> dict[str, float]:
    return {series(r): round(float(r["value"][1]), 4)
            for r in api(prom.url, "query", query=expr)["result"]}


def seen(prom: Prom, expr: str) -> dict[str, float]:
    """Each series' highest value over the test (per-job series end with their job)."""
    data = api(prom.url, "query_range", query=expr, start=str(prom.started),
               end=str(time.time()), step="1")
    return {series(r): round(max(float(v) for _, v in r["values"]), 4)
            for r in data["result"]}


def near(values: dict[str, float], want: dict[str, float]) -> bool:
    """Every listed series at its value (an increase is extrapolated by a fraction of a
    scrape interval), every other one at 0."""
    keys = set(values) | set(want)
    return all(abs(values.get(k, 0.0) - want.get(k, 0.0)) < 0.1 for k in keys)


def check_dashboard_and_rules(sandbox: Sandbox, prom: Prom, job_id: int, idle: str,
                              other: str, pinned: int) -> None:
    """Evaluate every dashboard expression and alert rule; assert what the faults made:
    ``idle`` drained for an Xid, ``other`` for a failed NCCL test.

    ``pinned`` is the job submitted to ``idle`` after the Xid. Its prolog normally finds
    the Xid first and fails it (a requeue, cause prolog); a HealthCheckProgram pass that
    falls between the injection and that prolog drains the node first, and the job then
    waits for it without a requeue. Which one happened is read from the job's restarts,
    and the requeue count must match it exactly."""
    # HealthCheckProgram passes find the Xid again and drain the drained node again.
    fails = (f'increase(slurm_resilience_gate_check_results_total{{check="xid",'
             f'result="fail"}}[1h]) {J}')
    wait_for(lambda: instant(prom, fails).get(f"check=xid,node={idle},result=fail", 0) >= 1.5,
             90, "a health-check pass after the prolog's finding the Xid again")
    wait_for(lambda: f"cause=health,node={idle}" in instant(
        prom, f"slurm_resilience_node_our_drain_since_timestamp_seconds {J}"), 90,
        "the drained node's agent seeing it in our drain")
    wait_for(lambda: instant(prom, f'slurm_resilience_nccl_test_passed{{variant="all"}} {J}'
                             ).get(f"node={other},variant=all") == 0, 90,
             "the failed NCCL test in the metrics")
    # Settled: pending again after the prolog's requeue, or pending all along.
    wait_for(lambda: sandbox.job(pinned).state == "PENDING", 120,
             "the job pinned to the drained node pending")
    by_prolog = 1 if sandbox.job(pinned).restarts > 0 else 0
    print(f"job {pinned} on {idle}: requeued by our prolog: {bool(by_prolog)}")
    if by_prolog:
        wait_for(lambda: instant(prom, 'sum(increase(slurm_resilience_job_requeues_total'
                                       '{cause="prolog"}[1h]))').get("-", 0) > 0.9, 120,
                 "the job our prolog failed for the Xid released by a health-check pass")
    # The hang's incident threads may still be writing their reports or verifying the suspect
    # after the job ended; the panels are read once none is open (one that never closes
    # fails this wait).
    open_expr = next(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
                     if p["title"] == "Open incidents" for t in p["targets"])
    wait_for(lambda: instant(prom, open_expr) == {"-": 0}, 180, "no hang incident open")
    prom.gone.shutdown()  # the stand-in agent stops answering
    nodes = sandbox.nodes
    up = {**{f"node={n}": 1.0 for n in nodes}, f"node={GONE}": 0.0}
    wait_for(lambda: instant(prom, next(t["expr"] for p in json.loads(DASHBOARD.read_text())[
        "panels"] if p["title"] == "Agents up, by node" for t in p["targets"])) == up, 30,
        "the stand-in agent scraped as down, every agent up")
    got: dict[str, dict[str, float]] = {}
    earlier: dict[str, dict[str, float]] = {}  # per-job series ended with their job

    def evaluate(key: str, expr: str) -> None:
        got[key], earlier[key] = instant(prom, expr), seen(prom, expr)
        print(f"{key}: now {got[key]}; over the test {earlier[key]}")

    for dash_panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in dash_panel.get("targets", []):
            evaluate(f"panel {dash_panel['title']!r} [{t['legendFormat']}]", t["expr"])
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    loaded = {r["name"]: r for g in api(prom.url, "rules")["groups"] for r in g["rules"]}
    for rule in rules:
        assert loaded[rule["alert"]]["health"] == "ok", loaded[rule["alert"]]
        evaluate(f"alert {rule['alert']}", rule["expr"])

    def panel(title: str, legend: str, over_the_test: bool = False) -> dict[str, float]:
        return (earlier if over_the_test else got)[f"panel {title!r} [{legend}]"]

    # one Xid drain, one NCCL drain, one hang incident, one requeue by hang handling and
    # one by Slurm after the Xid prolog: each an increase of 1, once
    drains = panel("Drains by cause (1h)", "{{cause}}")
    by_node = instant(prom, f"increase(slurm_resilience_node_drains_total[1h]) {J}")
    assert near({k: v for k, v in drains.items() if k != "cause=hang_suspect"},
                {"cause=health": 1, "cause=nccl": 1}), (
        drains, by_node, sandbox.run(["sinfo", "-R", "-h", "-o", "%n|%E"]).stdout)
    assert drains.get("cause=hang_suspect", 0) < 1.1, drains  # the hang's suspect, if drained
    assert near(panel("Incidents by decision (1h)", "{{decision}}"),
                {"decision=requeue": 1}), got
    requeued = panel("Requeues and holds (1h)", "requeued {{cause}}")
    assert near(requeued, {"cause=hang": 1, "cause=prolog": by_prolog}), requeued
    assert near(panel("Requeues and holds (1h)", "held {{cause}}"), {}), got
    assert near(panel("Requeues and holds (1h)", "cancelled {{cause}}"), {}), got
    assert near(panel("Hang budget spent (1h)", "{{node}} {{by}}"), {}), got
    assert panel("Open incidents", "open") == {"-": 0}
    assert panel("Agents answering", "agents") == {"-": len(nodes)}
    assert panel("Agents up, by node", "{{node}}") == up
    assert panel("Gate checks failing now", "{{check}}").get("check=xid", 0) >= 1
    stale = panel("Gate staleness (since the last run)", "{{node}}")
    assert set(stale) == {f"node={n}" for n in nodes} and max(stale.values()) < 120, stale
    assert f"cause=health,node={idle}" in panel("Nodes in our drain, for how long",
                                                "{{node}} {{cause}}")
    assert panel("Agent collect errors", "{{node}} {{source}}") == {}
    assert panel("Agent service tick failures (1h)", "{{node}} {{service}}") == {}
    assert set(panel("Upload backlog per node", "{{node}}")) == {f"node={n}" for n in nodes}
    job = f"job_id={job_id}"
    # The hang's incident is open only while its evidence is taken and the requeue made
    # (seconds); on a loaded machine no 1 s scrape may land in that window. The gauge's
    # value is the collector's unit test's (test_metrics), its name the dashboard test's;
    # here the panel must never count more than the one hang.
    opened = panel("Open incidents", "open", over_the_test=True)
    assert opened in ({"-": 0}, {"-": 1}), opened
    if opened == {"-": 0}:
        print("no scrape landed while the hang's incident was open")
    worst = panel("Worst goodput among running jobs", "job {{job_id}}", over_the_test=True)
    assert 0 < worst[job] <= 1, worst
    for title, legend in (("Step time per job (p50 / p95 per node)", "p50 job {{job_id}}"),
                          ("Commit latency (newest step)", "job {{job_id}}"),
                          ("Checkpoint save stall", "max job {{job_id}}")):
        assert panel(title, legend, over_the_test=True).get(job, 0) > 0, title
    passed = panel("NCCL test passed", "{{node}} {{variant}}")
    assert passed[f"node={other},variant=all"] == 0 and set(passed.values()) == {0}, passed
    # the alerts now: the stand-in is the one agent down, other's NCCL test fails; nothing
    # else (the rules' `for` is promtool's to test: their expressions are evaluated here)
    assert got["alert SlurmResilienceAgentDown"] == {f"node={GONE}": 1}
    assert got["alert SlurmResilienceNcclGateFailing"] == {f"node={other},variant=all": 0}
    for quiet in ("GateStale", "ConfigInvalid", "NodeDrainedLong", "UploadBacklogGrowing",
                  "HangBudgetSpent", "JobGoodputLow"):
        assert got[f"alert SlurmResilience{quiet}"] == {}, quiet
    # the hung job's goodput was under the threshold while it ran (0.14 to 0.18 here)
    assert set(earlier["alert SlurmResilienceJobGoodputLow"]) == {job}, earlier


def test_prometheus_sees_drain_incident_goodput_and_backlog_and_goodput_adds_up(
        sandbox: Sandbox, prometheus: Prom, test_users: tuple[str, ...]) -> None:
    """A hung job requeued and resumed, an Xid drain and a failed NCCL test are what a
    real Prometheus shows in every dashboard query and alert rule, and goodput adds up."""
    user = test_users[0]
    work = sandbox.user_dir(user, "prom")
    job_id = submit(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                         "--hang-rank 1")
    wait_for_decision(sandbox, work, job_id)
    final = sandbox.wait_job(job_id, timeout=180)
    out = output(work, job_id)
    assert final.state == "COMPLETED", out

    # An Xid on a node the job is not on now: its prolog drains it.
    idle, other = [n for n in sandbox.nodes if n not in final.nodes][:2]
    print(faults.inject(sandbox.state_dir, idle, "gpu-xid:2:79"))
    pinned = sandbox.sbatch("true\n", args=["-w", idle])
    # A wrong all-reduce sum on the other: the NCCL test of its whole-node job drains it.
    print(faults.inject(sandbox.state_dir, other, "nccl-wrong:1"))
    sandbox.update_resilience_config({"nccl": {"enabled": True, "idle_verify": False}})
    sandbox.sbatch("true\n", args=["-w", other, "--exclusive"])

    job = f'job_id="{job_id}"'
    # The Xid node's own series: the shared sandbox's other nodes may carry health drains of
    # earlier tests, and one of those must not end the wait before this one is scraped.
    port = str(sandbox.layout.metrics_port(sandbox.nodes.index(idle) + 1))
    want = {
        "drain": f'slurm_resilience_node_drains_total{{cause="health",instance=~".*:{port}"}}'
                 f' >= 1',
        "incident": 'slurm_resilience_hang_incidents_total{decision="requeue"} >= 1',
        "goodput": f"last_over_time(slurm_resilience_job_goodput_ratio{{{job}}}[10m])",
        "backlog": f"last_over_time(slurm_resilience_checkpoint_upload_backlog_steps{{{job}}}"
                   f"[10m])",
    }
    got = {k: wait_for(lambda q=q: query(prometheus.url, q), 60, k) for k, q in want.items()}
    assert any(r["metric"]["instance"].endswith(f":{port}") for r in got["drain"]), got
    ratios = [float(r["value"][1]) for r in got["goodput"]]
    assert ratios and all(0 < r <= 1 for r in ratios), got["goodput"]
    check_dashboard_and_rules(sandbox, prometheus, job_id, idle, other, pinned)

    # goodput over the nodes of both runs (the requeued run avoids the suspect node)
    runs = re.findall(r"rank \d running step=\d+ at=[\d.]+ restarts=(\d) node=(\w+)", out)
    b = goodput(sandbox, job_id, sorted({n for _, n in runs}))
    print(json.dumps(b, indent=1))
    assert len(b["runs"]) == 2
    report = acting(reports(sandbox, job_id), 0)
    assert report is not None
    clock = job_clock(out)
    print(f"job clock: {clock}")
    # All the allocation is explained but the gap between the steps' time on the job's own
    # clock and goodput's estimate of it (each run's mean step time, beat to beat, times its
    # kept steps), to the runs' first steps and an agent tick at each end of each run.
    gap = clock_minus_productive_s(clock, b["productive_s"])
    assert abs(b["unexplained_s"] - gap) <= 3.0, (b["unexplained_s"], gap, b)
    (hang_step, hung_at), = clock["hangs"]
    assert hang_step == 12
    detected = float(report["detected_at"])  # type: ignore[arg-type]
    losses = b["losses_s"]
    want = {"lost_since_checkpoint": (hung_at - clock["checkpoints"][10][0], 1.0),
            "hung_before_detection": (detected - hung_at, 1.5),
            # one agent tick (0.5 s) of rounding either way
            "checkpoint_stall": (sum(s for _, s in clock["checkpoints"].values()), 1.0)}
    for kind, (known_s, tol) in want.items():
        assert abs(losses[kind] - known_s) <= tol, (kind, losses[kind], known_s, tol)
    r1 = b["runs"][1]["losses"]
    assert 0 < r1["stagein"] + r1["before_first_step"] <= clock["running"][1] - detected, b
    # at least the steps' sleeps; at most the time the job's own clock shows it stepping
    # (run 0 from its first step to the hang, run 1 from its first step to done)
    stepping = (hung_at - clock["running"][0]) + (clock["done"] - clock["running"][1])
    assert 28 * 0.1 <= b["productive_s"] <= stepping + 1.0, (b, stepping)
