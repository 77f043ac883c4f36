"""Acceptance: a real Prometheus server (Debian's package) scrapes every sandbox agent.

After an injected Xid, a hang and a checkpointed job, PromQL against that server returns the
drain, incident, goodput and upload-backlog series. The job hung once and resumed; its
`goodput` over the nodes it ran on accounts for at least 95% of its allocated time with
productive time measured from step times (``explained_share``), and the losses match the
job's own printed clock (examples/train.py's ``at=`` stamps) and its hang report, to one
agent tick (heartbeat.interval_s = 0.5 s) plus the stamp's distance from the event:

* lost since checkpoint: from the checkpoint of step 10 to the hang before step 12, 1.0 s;
* hung before detection: from the printed hang to the report's detection time, 1.5 s;
* checkpoint stalls: the printed stall_ms of every save the runs kept, 0.5 s in all;
* stage-in + before the first step of run 1: at most the time from the hang's detection to
  run 1's "running" line (its allocation starts in between), and more than 0;
* productive: 28 kept steps (2..10, then 12..30) of 0.1 s sleep plus compute: between 2.8 s
  and 14 s.

The allocation times come from the agents here (no accounting in this sandbox); the
accounting sandbox checks the rest against sacct's run times.
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
from hang_jobs import acting, job_clock, output, reports, submit, wait_for

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
    assert b["explained_share"] >= 0.95, (b["unexplained_s"], b["allocated_s"])
    report = acting(reports(sandbox, job_id), 0)
    assert report is not None
    clock = job_clock(out)
    print(f"job clock: {clock}")
    (hang_step, hung_at), = clock["hangs"]
    assert hang_step == 12
    detected = float(report["detected_at"])  # type: ignore[arg-type]
    losses = b["losses_s"]
    want = {"lost_since_checkpoint": (hung_at - clock["checkpoints"][10][0], 1.0),
            "hung_before_detection": (detected - hung_at, 1.5),
            "checkpoint_stall": (sum(s for _, s in clock["checkpoints"].values()), 0.5)}
    for kind, (known_s, tol) in want.items():
        assert abs(losses[kind] - known_s) <= tol, (kind, losses[kind], known_s, tol)
    r1 = b["runs"][1]["losses"]
    assert 0 < r1["stagein"] + r1["before_first_step"] <= clock["running"][1] - detected, b
    assert 28 * 0.1 <= b["productive_s"] <= 28 * 0.5, b
