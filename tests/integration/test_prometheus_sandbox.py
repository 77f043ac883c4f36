"""Acceptance: a real Prometheus server (Debian's package) scrapes every sandbox agent.

After an injected Xid, a hang and a checkpointed job, PromQL against that server returns the
drain, incident, goodput and upload-backlog series. The job hung once and resumed; its
`goodput` over the nodes it ran on accounts for its allocated time, and the losses match
what was injected: time hung before detection within 1.5 s of the report's figure (the
ledger samples slots every heartbeat.interval_s = 0.5 s), work lost since the checkpoint at
most 2 s (one step, 0.1 s plus compute, was done after the checkpoint at step 10).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hang_jobs import acting, output, reports, submit, wait_for

from slurm_resilience.sandbox import control, faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus(sandbox: Sandbox, tmp_path: Path) -> Iterator[str]:
    """A Prometheus server scraping every agent each second; yields its base URL."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: `make setup` installs Debian's prometheus package"
    targets = [f"127.0.0.1:{sandbox.layout.metrics_port(i)}"
               for i in range(1, len(sandbox.nodes) + 1)]
    conf = tmp_path / "prometheus.yml"
    conf.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
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
        wait_for(lambda: len(query(url, 'up{job="slurm-resilience"} == 1')) == len(targets),
                 60, "every agent scraped by Prometheus")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for node in sandbox.nodes:
            faults.heal(sandbox.state_dir, node)


def query(base: str, promql: str) -> list[dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{base}/api/v1/query?"
                                    + urllib.parse.urlencode({"query": promql}),
                                    timeout=10) as resp:
            answer = json.loads(resp.read())
    except OSError:
        return []
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


def goodput(sandbox: Sandbox, job_id: int, nodes: list[str]) -> dict[str, Any]:
    """The job's goodput from the records of every node it ran on (the sandbox's nodes
    share this host, so one command reads them all)."""
    args = [a for n in nodes for a in ("--node", n)]
    out = subprocess.run([sys.executable, "-m", "slurm_resilience", "goodput", str(job_id),
                          *args, "--json"], capture_output=True, text=True,
                         timeout=60, env=control.user_env(sandbox.layout))
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_prometheus_sees_drain_incident_goodput_and_backlog_and_goodput_adds_up(
        sandbox: Sandbox, prometheus: str, test_users: tuple[str, ...]) -> None:
    user = test_users[0]
    work = sandbox.user_dir(user, "prom")
    job_id = submit(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                         "--hang-rank 1")
    wait_for(lambda: acting(reports(sandbox, job_id), 0), 120, "the requeue decision")
    final = sandbox.wait_job(job_id, timeout=180)
    out = output(work, job_id)
    assert final.state == "COMPLETED", out

    # An Xid on a node the job is not on now: its prolog drains it.
    idle = next(n for n in sandbox.nodes if n not in final.nodes)
    print(faults.inject(sandbox.state_dir, idle, "gpu-xid:2:79"))
    sandbox.sbatch("true\n", args=["-w", idle])

    job = f'job_id="{job_id}"'
    want = {
        "drain": 'slurm_resilience_node_drains_total{cause="health"} >= 1',
        "incident": 'slurm_resilience_hang_incidents_total{decision="requeue"} >= 1',
        "goodput": f"last_over_time(slurm_resilience_job_goodput_ratio{{{job}}}[10m])",
        "backlog": f"last_over_time(slurm_resilience_checkpoint_upload_backlog_steps{{{job}}}"
                   f"[10m])",
    }
    got = {k: wait_for(lambda q=q: query(prometheus, q), 60, k) for k, q in want.items()}
    port = str(sandbox.layout.metrics_port(sandbox.nodes.index(idle) + 1))
    assert any(r["metric"]["instance"].endswith(f":{port}") for r in got["drain"]), got
    ratios = [float(r["value"][1]) for r in got["goodput"]]
    assert ratios and all(0 < r <= 1 for r in ratios), got["goodput"]

    # goodput over the nodes of both runs (the requeued run avoids the suspect node)
    runs = re.findall(r"rank \d running step=\d+ at=[\d.]+ restarts=(\d) node=(\w+)", out)
    b = goodput(sandbox, job_id, sorted({n for _, n in runs}))
    print(json.dumps(b, indent=1))
    assert len(b["runs"]) == 2
    accounted = b["productive_s"] + sum(b["losses_s"].values())
    assert accounted >= 0.95 * b["allocated_s"]
    report = acting(reports(sandbox, job_id), 0)
    assert report is not None
    detect_s = float(report["detected_at"]) - float(report["timings"]["hang_started_at"])
    assert abs(b["losses_s"]["hung_before_detection"] - detect_s) <= 1.5, (b, detect_s)
    # Injected: the checkpoint at step 10, the hang before step 12: one step of work lost
    # (0.1 s of sleep plus compute), seen to within one agent tick.
    assert 0 <= b["losses_s"]["lost_since_checkpoint"] <= 2.0, b
    assert b["losses_s"]["restart"] > 0 and b["productive_s"] > 0
