"""A job killed by a node fault restarts by itself, away from the node; a job that fails
on healthy nodes is left alone. Real slurmctld/slurmd; the fault is the stand-in's Xid 79."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience import events
from slurm_resilience.hang.requeue import parse_ledger
from slurm_resilience.health.faultrequeue import parse_ledger as fault_ledger
from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox

# First run: say where it runs, then wait for the test's go (the fault is in by then) and
# fail as a process whose GPU fell off the bus does. A later run finishes.
SCRIPT = """#!/bin/sh
dir={dir}
echo "run restarts=${{SLURM_RESTART_COUNT:-0}} node=$SLURMD_NODENAME"
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
    echo "$SLURMD_NODENAME" > "$dir/node"
    i=0
    while [ ! -e "$dir/go" ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done
    echo "CUDA error: unspecified launch failure"
    exit {code}
fi
echo "done on $SLURMD_NODENAME"
"""


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def wait_file(path: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} not written within {timeout:g}s")
        time.sleep(0.2)
    return path.read_text().strip()


def requeues(box: Sandbox, cause: str) -> int:
    total = 0
    for node in box.nodes:
        path = events.path_for(str(box.state_dir / "nodes" / "{node}" / "state"), node)
        if Path(path).exists():
            total += json.loads(Path(path).read_text())["counters"].get(
                f"{events.REQUEUE}|{cause}", 0)
    return total


def submit(box: Sandbox, work: Path, code: int) -> int:
    work.mkdir(mode=0o755)
    return box.sbatch(SCRIPT.format(dir=work, code=code),
                      args=["-N1", "--requeue", "--open-mode=append"])


def test_job_killed_by_an_xid_is_requeued_elsewhere_and_completes(box: Sandbox,
                                                                 tmp_path: Path) -> None:
    """Xid 79 on the job's node mid-run, then the job exits non-zero: the epilog drains
    the node and requeues the job (its own count, not the hang count) onto another node,
    where it completes."""
    before = requeues(box, "node_fault")
    work = tmp_path / "xid"
    job = submit(box, work, 3)
    node = wait_file(work / "node")
    print(faults.inject(box.state_dir, node, "gpu-xid:0:79"))
    (work / "go").touch()
    info = box.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180, poll=0.5)
    out = box.output(job)
    print(f"job {job}: {info.state} on {info.nodes} after {info.restarts} requeue(s)\n{out}")
    assert info.state == "COMPLETED", out
    assert info.restarts == 1
    assert node not in info.nodes and node in info.exc_nodes
    assert re.search(r"done on (?!" + node + r"\b)\w+", out), out
    assert fault_ledger(info.admin_comment).requeues == 1, info.admin_comment
    assert f"node fault on {node}: gpu0 XID 79" in info.admin_comment
    assert parse_ledger(info.admin_comment) is None  # the hang count is untouched
    assert box.adapter().show_node(node).drained
    assert requeues(box, "node_fault") == before + 1


def test_job_failing_on_healthy_nodes_is_not_requeued(box: Sandbox, tmp_path: Path) -> None:
    """No fault on the node: the job's own failure ends it (FAILED, no restart)."""
    work = tmp_path / "healthy"
    job = submit(box, work, 5)
    wait_file(work / "node")
    (work / "go").touch()
    info = box.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120, poll=0.5)
    assert info.state == "FAILED", box.output(job)
    assert info.restarts == 0
    assert "sr-fault" not in info.admin_comment
