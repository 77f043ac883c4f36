"""Straggler nodes in the sandbox: a job whose ranks step on their own (no collective per
step: a data-parallel inference or preprocessing job) with one node slowed by the sandbox
fault ``node-slow:30`` is named as a straggler by the agents: the job's judging agent (its
first node) names it from the nodes' summaries sent over the agents' exchange, the slowed
node's own agent records it (``node_straggler_recent_jobs``,
``job_straggler_node_slowdown_ratio``) and ``status --cluster`` shows what the agents
report; the same job on healthy nodes names none over 300 steps.

Bound: every node's agent samples one step time per heartbeat tick (0.5 s in the sandbox)
and a node is judged once its window holds stragglers.min_steps (50) samples, about 25 s in;
the judge judges every stragglers.node_interval_s (2 s in the sandbox) and names after
persist_evaluations (10) slow judgements, about 20 s more, plus up to two intervals for the
summaries to climb the fan-out-2 tree: about 50 s, step ~150 of the slowed node. It must be
named before the slowest node's step 290, and the test prints when it was. (In a job that
synchronises every step, such as DDP, every rank waits for the slowest at each collective,
so step times alone cannot tell which node it is.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience.metrics import cluster as cluster_view
from slurm_resilience.sandbox import control, faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
STEPS = 300
STEP_S = 0.25

WORKLOAD = """
import os, sys, time
from slurm_resilience import heartbeat
node = os.environ["SLURMD_NODENAME"]
try:
    factor = float(open(os.path.join(sys.argv[1], node, "slow-factor")).read())
except FileNotFoundError:
    factor = 1.0
for step in range(1, int(sys.argv[2]) + 1):
    time.sleep(float(sys.argv[3]) * factor)  # the stand-in GPU's compute
    heartbeat.beat(step)
    if step % 10 == 0:
        print(f"{node} step={step}", flush=True)
heartbeat.done()
"""


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def submit(box: Sandbox) -> tuple[int, Path]:
    script = box.jobs_dir / f"workload-{time.time_ns()}.py"
    script.write_text(WORKLOAD)
    script.chmod(0o644)
    n = len(box.nodes)
    job = box.sbatch(f"srun -N{n} -n{n} {PYTHON} -u {script} {box.layout.nodes_dir} {STEPS} "
                     f"{STEP_S}\n", args=[f"-N{n}", f"-n{n}"])
    return job, box.jobs_dir / f"slurm-{job}.out"


def min_step(out: Path) -> int:
    text = out.read_text() if out.exists() else ""
    last: dict[str, int] = {}
    for node, step in re.findall(r"(\w+) step=(\d+)", text):
        last[node] = int(step)
    return min(last.values()) if last else 0


def cluster(box: Sandbox) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "slurm_resilience", "status", "--cluster",
                          "--json"], capture_output=True, text=True, timeout=120,
                         env=control.user_env(box.layout))
    assert out.returncode in (0, 1), out.stderr
    view: dict[str, Any] = json.loads(out.stdout)
    return view


def named(view: dict[str, Any], job: int) -> list[str]:
    return sorted(s["node"] for s in view["straggler_nodes"] if s["job_id"] == job)


def agent_metrics(box: Sandbox, node: str) -> list[tuple[str, dict[str, str], float]]:
    url = f"http://127.0.0.1:{box.layout.metrics_port(box.nodes.index(node) + 1)}/metrics"
    return cluster_view.parse(cluster_view.fetch(url, 10))


def metric(box: Sandbox, node: str, name: str, job: int | None = None) -> float | None:
    for n, labels, v in agent_metrics(box, node):
        if n == f"slurm_resilience_{name}" and (job is None or labels.get("job_id") == str(job)):
            return v
    return None


def judged(box: Sandbox, job: int) -> dict[str, float]:
    """Nodes of the job named by its judging agent, as each agent's metrics say."""
    out = {}
    for node in box.nodes:
        v = metric(box, node, "job_straggler_nodes", job)
        if v is not None:
            out[node] = v
    return out


def test_a_slowed_node_is_named_and_a_normal_job_names_none(box: Sandbox) -> None:
    slow = box.nodes[2]
    print(faults.inject(box.state_dir, slow, "node-slow:30"))
    job, out = submit(box)
    deadline = time.monotonic() + 240
    while True:
        view = cluster(box)
        if named(view, job):
            break
        assert min_step(out) < STEPS - 10 and time.monotonic() < deadline, (
            f"not named by step {min_step(out)}: {view}")
        time.sleep(1)
    print(f"named {named(view, job)} at step {min_step(out)} of the slowest node")
    assert named(view, job) == [slow]
    # Named by the agents: the slowed node's own agent recorded it, the judge counts it.
    assert (metric(box, slow, "job_straggler_node_slowdown_ratio", job) or 0) > 0.1
    assert (metric(box, slow, "node_straggler_recent_jobs") or 0) >= 1
    assert judged(box, job) == {box.nodes[0]: 1.0}, judged(box, job)
    for other in box.nodes:
        if other != slow:
            assert metric(box, other, "job_straggler_node_slowdown_ratio", job) is None
    box.run(["scancel", str(job)])
    faults.heal(box.state_dir, slow)

    job, out = submit(box)
    checks = 0
    judging = False
    deadline = time.monotonic() + 300
    while min_step(out) < STEPS - 10:
        assert time.monotonic() < deadline, "the normal job did not progress"
        view = cluster(box)
        assert named(view, job) == [], view
        now_judged = judged(box, job)
        assert not any(now_judged.values()), now_judged
        judging = judging or box.nodes[0] in now_judged
        checks += 1
        time.sleep(1)
    print(f"normal job: {checks} cluster views up to step {min_step(out)}, no straggler")
    assert min_step(out) >= 200 and checks > 10
    assert judging, "the job's first node never judged it"
    box.wait_job(job, timeout=120)
