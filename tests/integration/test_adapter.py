"""The Slurm adapter's job operations and typed errors, against the real sandbox."""

from __future__ import annotations

import pytest
from hang_jobs import wait_for

from slurm_resilience.proc import STATS
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.slurm.errors import JobNotFound, NodeNotFound, SlurmError

pytestmark = pytest.mark.sandbox


def test_requeue_hold_then_release_runs_again(sandbox: Sandbox) -> None:
    """requeue_hold holds the job with a visible admin comment; release lets it run again."""
    ctl = sandbox.adapter()
    job = sandbox.sbatch("echo run $SLURM_RESTART_COUNT; sleep 300",
                         args=["-N1", "--requeue", "--open-mode=append"])
    sandbox.wait_job(job, {"RUNNING"}, timeout=60)
    ctl.requeue_hold(job, "hang cap reached (3 requeues)")
    held = sandbox.wait_job(job, {"PENDING"}, timeout=60)
    assert "Held" in held.reason or "held" in held.reason.lower()
    assert held.admin_comment == "SR: hang cap reached (3 requeues)"
    ctl.release(job)
    again = sandbox.wait_job(job, {"RUNNING"}, timeout=90)
    assert again.restarts == 1
    sandbox.run(["scancel", str(job)])


def test_excluded_nodes_are_merged_and_honoured(sandbox: Sandbox) -> None:
    """exclude_nodes adds to a pending job's ExcNodeList and the job avoids those nodes."""
    ctl = sandbox.adapter()
    job = sandbox.sbatch("echo $SLURMD_NODENAME", args=["-N1", "--hold", "--exclude=node1"])
    merged = ctl.exclude_nodes(job, ["node2", "node3"])
    assert merged == ("node1", "node2", "node3")
    assert ctl.show_job(job).exc_nodes == ("node1", "node2", "node3")
    ctl.release(job)
    done = sandbox.wait_job(job, timeout=60)
    assert done.state == "COMPLETED"
    assert sandbox.output(job).strip() == "node4"


def test_errors_are_typed_and_carry_slurms_message(sandbox: Sandbox) -> None:
    """Unknown nodes and jobs raise typed errors with what Slurm said; calls are counted."""
    ctl = sandbox.adapter()
    before = STATS.failures["scontrol"]
    with pytest.raises(NodeNotFound) as node_err:
        ctl.show_node("node99")
    assert "node99" in str(node_err.value) or "not found" in str(node_err.value).lower()
    with pytest.raises((JobNotFound, SlurmError)) as job_err:
        ctl.requeue(999999)
    assert "Invalid job id" in job_err.value.slurm_message
    # 23.02+ answers an unknown node in JSON with an empty list and exit 0: only the
    # requeue is a failed call there.
    assert STATS.failures["scontrol"] >= before + (1 if ctl.slurm_version() >= (23, 2) else 2)


def test_list_jobs_filters_by_node(sandbox: Sandbox) -> None:
    """squeue --json is parsed and filtered by node here (22.05 ignores its filters)."""
    ctl = sandbox.adapter()
    job = sandbox.sbatch("sleep 300", args=["-N1", "-w", "node2"])
    sandbox.wait_job(job, {"RUNNING"}, timeout=60)
    on_node2 = [j.job_id for j in ctl.list_jobs(node="node2")]
    on_node3 = [j.job_id for j in ctl.list_jobs(node="node3")]
    assert job in on_node2 and job not in on_node3
    sandbox.run(["scancel", str(job)])


def test_node_in_use_names_a_step_but_not_a_bare_allocation(sandbox: Sandbox) -> None:
    """What the suspect verifier asks before verifying a node its job still holds: a step of
    the job on the node (the batch script's included) is named; a node the job holds with
    no step on it is not in use (its extern step aside)."""
    ctl = sandbox.adapter()
    job = sandbox.sbatch("srun -N1 -n1 -w node3 sleep 300\n", args=["-N3", "-w", "node[2-4]"])
    sandbox.wait_job(job, {"RUNNING"}, timeout=60)
    wait_for(lambda: ctl.node_in_use("node3", job) != "", 60, "the srun step on node3")
    assert ctl.node_in_use("node3", job) == f"step {job}.0 on node3"
    assert ctl.node_in_use("node2", job) == f"step {job}.batch on node2"
    assert ctl.node_in_use("node4", job) == ""
    assert ctl.node_in_use("node4", job + 1) == f"job {job} on node4"
    sandbox.run(["scancel", str(job)])
