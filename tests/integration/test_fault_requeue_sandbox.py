"""A job killed by a node fault restarts by itself, away from the node; a job that fails
on healthy nodes is left alone. Real slurmctld/slurmd; the fault is the stand-in's Xid 79."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience import events
from slurm_resilience.hang.requeue import parse_ledger
from slurm_resilience.health.faultrequeue import parse_ledger as fault_ledger
from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.slurmconf import CRED_EXPIRE_S

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
    """The node-local requeue counters of ``cause``, summed over the sandbox's nodes."""
    return sum(events.read(events.path_for(str(box.state_dir / "nodes" / "{node}" / "state"),
                                           node))["counters"].get(f"{events.REQUEUE}|{cause}", 0)
               for node in box.nodes)


def submit(box: Sandbox, work: Path, code: int, requeue: str = "--requeue") -> int:
    work.mkdir(mode=0o755)
    return box.sbatch(SCRIPT.format(dir=work, code=code),
                      args=["-N1", requeue, "--open-mode=append"])


def test_job_killed_by_an_xid_is_requeued_elsewhere_and_completes(box: Sandbox,
                                                                 tmp_path: Path) -> None:
    """Xid 79 on the job's node mid-run, then the job exits non-zero: the epilog drains
    the node and requeues the job (its own count, not the hang count) onto another node,
    where it completes."""
    before = requeues(box, "node_fault")
    node, info, out = killed_by_an_xid(box, tmp_path / "xid")
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


EXPEDITED_SINCE = (25, 11)


def test_a_job_asking_for_expedited_requeue_restarts_at_once_after_a_node_fault(
        box: Sandbox, sandbox_factory: Callable[..., Sandbox], tmp_path: Path) -> None:
    """``--requeue=expedite`` is refused where the site does not allow it (and before
    25.11, whose sbatch has no such value). Where it does: the epilog's node-fault requeue
    (held, the node excluded, released) makes the job eligible at its first scheduling
    pass (no cred_expire wait) and it completes on the other node; a failure on healthy
    nodes is Slurm's to hold (REQUEUE_HOLD), never a node-fault requeue of ours."""
    refused = box.run(["sbatch", "--requeue=expedite", "--wrap=true"], check=False)
    assert refused.returncode != 0, refused.stdout
    print(refused.stderr.strip())
    version = box.adapter().slurm_version()  # 26.05's scontrol --version needs a config
    if version < EXPEDITED_SINCE:
        return  # what Slurm does with it from 25.11 on is checked on those versions
    box = sandbox_factory(nodes=2, leaves=1, slurm_overrides={
        "SlurmctldParameters": "enable_expedited_requeue"})
    try:
        expedited_after_a_fault(box, tmp_path)
    finally:
        for node in box.nodes:
            faults.heal(box.state_dir, node)


def killed_by_an_xid(box: Sandbox, work: Path, requeue: str = "--requeue"
                     ) -> tuple[str, Any, str]:
    """A requeueable job whose node gets a fatal Xid mid-run (its process then exits
    non-zero): the node it was on, its final job info and its output."""
    job = submit(box, work, 3, requeue)
    node = wait_file(work / "node")
    print(faults.inject(box.state_dir, node, "gpu-xid:0:79"))
    (work / "go").touch()
    info = box.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180, poll=0.5)
    out = box.output(job)
    print(f"job {job}: {info.state} on {info.nodes} after {info.restarts} requeue(s)\n{out}")
    return node, info, out


def expedited_after_a_fault(box: Sandbox, tmp_path: Path) -> None:
    node, info, out = killed_by_an_xid(box, tmp_path / "expedite-xid", "--requeue=expedite")
    assert info.state == "COMPLETED", out
    assert info.restarts == 1 and node in info.exc_nodes and node not in info.nodes
    assert fault_ledger(info.admin_comment).requeues == 1, info.admin_comment
    # Slurm makes a requeued job eligible requeue_delay (here cred_expire) + 1 s after its
    # new SubmitTime, an expedited one at its first scheduling pass after the release.
    eligible: Any = info.raw.get("eligible_time")
    eligible = int(eligible.get("number", 0)) if isinstance(eligible, dict) else int(eligible)
    assert info.submit_time <= eligible < info.submit_time + CRED_EXPIRE_S + 1, \
        (info.submit_time, eligible)

    work = tmp_path / "expedite-healthy"
    job = submit(box, work, 5, "--requeue=expedite")
    wait_file(work / "node")
    (work / "go").touch()
    info = box.wait_job(job, {"REQUEUE_HOLD", "COMPLETED", "FAILED", "CANCELLED"},
                        timeout=120, poll=0.5)
    assert info.state == "REQUEUE_HOLD" and info.restarts == 1, box.output(job)
    assert "sr-fault" not in info.admin_comment
    box.run(["scancel", str(job)])
