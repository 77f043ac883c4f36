"""Every sandbox agent serves /metrics on its own port; `promtool check metrics` is clean on
each; an injected Xid's drain shows in the drained node's metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PYTHON_SYS, as_user
from prometheus_client.parser import text_string_to_metric_families

from slurm_resilience.sandbox import control, faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def scrape(url: str, timeout: float = 60.0) -> str:
    """The endpoint's text, once the agent listens (it may still be starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return str(resp.read().decode())
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def value(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_each_agent_serves_clean_metrics_and_status_lists_them(box: Sandbox) -> None:
    status = subprocess.run(
        [sys.executable, "-m", "slurm_resilience", "sandbox", "status", "--state-dir",
         str(box.state_dir)],
        capture_output=True, text=True, timeout=60, check=True).stdout
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's prometheus package"
    for i, node in enumerate(box.nodes, 1):
        url = box.layout.metrics_url(i)
        assert f"agent-{node}" in status and url in status, status
        text = scrape(url)
        assert value(text, "slurm_resilience_agent_info", node=node) == 1
        check = subprocess.run([promtool, "check", "metrics"], input=text,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), \
            f"{node}: {check.stdout}{check.stderr}"


def test_an_xid_drain_is_counted_in_the_node_metrics(box: Sandbox) -> None:
    url = box.layout.metrics_url(box.nodes.index("node2") + 1)
    before = value(scrape(url), "slurm_resilience_node_drains_total", cause="health") or 0.0
    print(faults.inject(box.state_dir, "node2", "gpu-xid:1:79"))
    box.sbatch("true\n", args=["-w", "node2"])
    deadline = time.monotonic() + 90
    while True:
        text = scrape(url)
        drains = value(text, "slurm_resilience_node_drains_total", cause="health") or 0.0
        if drains > before:
            break
        assert time.monotonic() < deadline, f"no drain counted on node2:\n{text}"
        time.sleep(0.5)
    assert value(text, "slurm_resilience_gate_check_last_result", check="xid",
                 result="fail") == 1
    assert (value(text, "slurm_resilience_gate_check_results_total", check="xid",
                  result="fail") or 0) >= 1
    view = cluster_view(box)
    assert (view["agents_scraped"], view["agents_total"]) == (len(box.nodes),) * 2, view
    drained = {d["node"]: d["reason"] for d in view["drained"]}
    assert "XID 79" in drained.get("node2", ""), view


def cluster_view(box: Sandbox) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "slurm_resilience", "status", "--cluster",
                          "--json"], capture_output=True, text=True, timeout=120,
                         env=control.user_env(box.layout))
    assert out.returncode in (0, 1), out.stderr
    view: dict[str, Any] = json.loads(out.stdout)
    return view


# Keeps N connections to each port trickling a request, one header line every 2 s (each
# read well within any per-read timeout), reopening each as it is cut, until stdin closes
# (at most 120 s); prints "trickling" once all are open.
TRICKLER = """
import select, socket, sys, time
ports, n = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2])
def opened(port):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\\r\\n")
    except OSError:
        pass
    return s
conns = [(p, opened(p)) for p in ports for _ in range(n)]
print("trickling", flush=True)
end = time.monotonic() + 120
while time.monotonic() < end and not select.select([sys.stdin], [], [], 2)[0]:
    for i, (p, s) in enumerate(conns):
        try:
            s.sendall(b"X-Slow: 1\\r\\n")
        except OSError:
            s.close()
            conns[i] = (p, opened(p))
"""


def test_status_answers_while_a_user_trickles_requests_at_every_agent(
        box: Sandbox, test_users: tuple[str, ...]) -> None:
    """An unprivileged user keeps 16 requests trickling in at each agent's /metrics (twice
    what once held every endpoint): `status --cluster` still hears from every agent."""
    ports = ",".join(str(box.layout.metrics_port(i)) for i in range(1, len(box.nodes) + 1))
    for i in range(1, len(box.nodes) + 1):
        scrape(box.layout.metrics_url(i))  # every agent listens
    attacker = subprocess.Popen([PYTHON_SYS, "-c", TRICKLER, ports, "16"],
                                **as_user(test_users[0]), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().strip() == "trickling"
        view = cluster_view(box)
        assert (view["agents_scraped"], view["agents_total"]) == (len(box.nodes),) * 2, view
    finally:
        assert attacker.stdin is not None
        attacker.stdin.close()
        attacker.wait(60)
