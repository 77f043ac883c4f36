"""Slurm 22.05 behaviour the suite relies on, checked against real daemons.

Other capabilities build on these facts: a failing prolog that drained the node
itself keeps our reason; the job is requeued without a hold and runs on another
node; HealthCheckProgram gets SLURMD_NODENAME but no SLURM_CONF.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox

PROLOG = """#!/bin/sh
# Fails once, on the first node that runs it; records its environment.
env | sort > {dir}/prolog-env.$SLURMD_NODENAME.$SLURM_JOB_ID
if mkdir {dir}/failed 2>/dev/null; then
    if [ -e {dir}/drain-first ]; then
        scontrol update NodeName=$SLURMD_NODENAME State=DRAIN Reason="SR: prolog test"
    fi
    echo $SLURMD_NODENAME > {dir}/failed/node
    exit 1
fi
exit 0
"""
HEALTHCHECK = """#!/bin/sh
env | sort > {dir}/hc-env.$SLURMD_NODENAME
"""


@pytest.fixture
def failing_prolog(sandbox_factory: object, tmp_path: Path) -> tuple[Sandbox, Path]:
    assert callable(sandbox_factory)
    tmp_path.chmod(0o755)
    for name, text in (("prolog", PROLOG), ("hc", HEALTHCHECK)):
        script = tmp_path / f"{name}.sh"
        script.write_text(text.format(dir=tmp_path))
        script.chmod(0o755)
    box = sandbox_factory(nodes=2, leaves=1, slurm_overrides={
        "Prolog": str(tmp_path / "prolog.sh"), "HealthCheckProgram": str(tmp_path / "hc.sh")})
    assert isinstance(box, Sandbox)
    return box, tmp_path


def run_through_failing_prolog(box: Sandbox, scratch: Path) -> tuple[str, int]:
    """Submit a job whose first prolog fails; returns the failed node and the job id."""
    job = box.sbatch("echo ran on $SLURMD_NODENAME\n", args=["--requeue"])
    deadline = time.monotonic() + 30
    requeued = box.job(job)
    while not (scratch / "failed" / "node").exists() or requeued.restarts == 0:
        assert time.monotonic() < deadline, f"job {job} not requeued: {requeued}"
        time.sleep(0.2)
        requeued = box.job(job)
    # Requeued, not held: a hold would show as priority 0 / "launch failed requeued held".
    assert requeued.priority != 0
    assert "held" not in requeued.reason.lower()
    final = box.wait_job(job, timeout=45)
    failed = (scratch / "failed" / "node").read_text().strip()
    assert final.state == "COMPLETED" and final.restarts == 1
    assert box.output(job).strip() == f"ran on {final.nodes[0]}"
    assert final.nodes[0] != failed
    return failed, job


def test_failing_prolog_keeps_our_drain_reason_and_requeues_without_hold(
        failing_prolog: tuple[Sandbox, Path]) -> None:
    """A prolog that drained its node with an SR: reason then failed keeps that reason, the
    job is requeued (not held) and completes on the other node; hooks' environments as known."""
    box, scratch = failing_prolog
    (scratch / "drain-first").touch()
    failed, _ = run_through_failing_prolog(box, scratch)
    node = box.adapter().show_node(failed)
    assert node.drained and node.reason == "SR: prolog test"
    check_hook_environments(box, scratch)


def test_failing_prolog_without_drain_gets_slurms_reason(
        failing_prolog: tuple[Sandbox, Path]) -> None:
    """A prolog that fails without draining leaves Slurm's own "Prolog error" reason."""
    box, scratch = failing_prolog
    failed, _ = run_through_failing_prolog(box, scratch)
    node = box.adapter().show_node(failed)
    assert node.drained and node.reason == "Prolog error"
    assert not box.adapter().ours(node.reason)


def check_hook_environments(box: Sandbox, scratch: Path) -> None:
    """The prolog gets SLURM_CONF and job variables; HealthCheckProgram only SLURMD_NODENAME."""
    prolog_env = next(scratch.glob("prolog-env.*")).read_text().splitlines()
    keys = {line.split("=", 1)[0] for line in prolog_env}
    assert {"SLURMD_NODENAME", "SLURM_CONF", "SLURM_JOB_ID", "SLURM_JOB_UID", "SLURM_JOB_USER",
            "SLURM_SCRIPT_CONTEXT", "SLURM_JOB_RESTART_COUNT"} <= keys
    assert f"SLURM_CONF={box.slurm_conf}" in prolog_env
    hc = {node: (scratch / f"hc-env.{node}").read_text().splitlines() for node in box.nodes}
    for node, lines in hc.items():
        assert f"SLURMD_NODENAME={node}" in lines
        assert not any(line.startswith(("SLURM_CONF=", "PATH=")) for line in lines)


# Stays in its steps' end for a while after the limit's SIGTERM, like a rank that saves.
OVER_LIMIT = """#!/bin/sh
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
    trap 'echo got TERM; sleep 3; exit 0' TERM
    while :; do sleep 1; done
fi
echo ran again
"""


def test_a_job_ended_at_its_time_limit_says_so_and_root_can_requeue_it(
        sandbox: Sandbox) -> None:
    """At the limit slurmctld ends the job (TIMEOUT; the reason TimeLimit, shown while its
    steps still end) and signals it; root can requeue it then, and it runs again. The
    agent's limits service relies on both for a run that saved at that SIGTERM. The limit
    is cut to the time already run (``scontrol update TimeLimit``, as an admin may) rather
    than waited for: slurmctld ends the job at its next check of the limits."""
    adapter = sandbox.adapter()
    job_id = sandbox.sbatch(OVER_LIMIT, args=["--time=10", "--requeue", "--open-mode=append"])
    deadline = time.monotonic() + 240
    cut = False
    while True:
        job = adapter.show_job(job_id)
        if job.state == "RUNNING" and not cut:
            sandbox.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=0"])
            cut = True
        elif job.state not in ("PENDING", "CONFIGURING", "RUNNING"):
            break
        assert time.monotonic() < deadline, f"job {job_id} still {job.state}"
        time.sleep(0.2)
    assert job.state in ("COMPLETING", "TIMEOUT"), job
    assert job.state == "TIMEOUT" or job.reason == "TimeLimit", job
    adapter.requeue(job_id, cause="time_limit")
    # The next run under a limit again: the requeued job still ends its steps (COMPLETING)
    # before it may start again. Before the requeue Slurm refuses this ("Job has already
    # finished").
    sandbox.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"])
    final = sandbox.wait_job(job_id, timeout=240)
    assert final.state == "COMPLETED" and final.restarts == 1, final
    out = sandbox.output(job_id)
    # (slurmstepd's "CANCELLED AT" line names the time limit or not, by which of
    # slurmctld's paths ended the job after the update: not what this checks.)
    assert out.index("got TERM") < out.index("ran again"), out
