"""Slurm accounting, the real thing: a sandbox with slurmdbd over MariaDB. The requeue of a
hung job shows in `sacct`, and our drain reasons in `sacctmgr show event`, the way a site
sees them."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import SandboxFactory
from hang_jobs import acting, reports, submit, wait_for

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def test_sacct_shows_the_hang_requeue_and_sacctmgr_our_drains(
        sandbox_factory: SandboxFactory, test_users: tuple[str, ...]) -> None:
    box: Sandbox = sandbox_factory(nodes=3, leaves=1, with_accounting=True)
    user = test_users[0]
    work = box.user_dir(user, "acct")
    job_id = submit(box, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                     "--hang-rank 1", nodes=1, tasks=2)
    wait_for(lambda: acting(reports(box, job_id), 0), 120, "the requeue decision")
    final = box.wait_job(job_id, timeout=180)
    assert final.state == "COMPLETED"

    def states() -> list[str]:
        out = box.run(["sacct", "-j", str(job_id), "--duplicates", "-X", "-n", "-P",
                       "-o", "JobID,State"]).stdout
        return [line.split("|")[1] for line in out.splitlines() if line.strip()]

    got = wait_for(lambda: (s := states()) and "REQUEUED" in s and "COMPLETED" in s and s,
                   60, "the requeue in sacct")
    print(f"sacct: job {job_id}: {got}")
    # Goodput takes the allocation times from accounting, the right source for them.
    out = box.run([sys.executable, "-m", "slurm_resilience", "goodput", str(job_id),
                   *[a for n in box.nodes for a in ("--node", n)], "--json"])
    b = json.loads(out.stdout)
    print(json.dumps(b, indent=1))
    assert "allocation times of 2 run(s) from Slurm accounting (sacct)" in b["notes"]
    assert len(b["runs"]) == 2
    assert b["productive_s"] + sum(b["losses_s"].values()) >= 0.95 * b["allocated_s"]
    # Accounting ends the hung run at the requeue (seconds after the detection); what the
    # restart costs after it shows in the next run (before its first step, stage-in).
    assert b["losses_s"]["hung_before_detection"] > 0
    assert b["runs"][1]["losses"]["before_first_step"] > 0

    idle = next(n for n in box.nodes if n not in final.nodes)
    print(faults.inject(box.state_dir, idle, "gpu-xid:1:79"))
    try:
        box.sbatch("true\n", args=["-w", idle])

        def events() -> str:
            return str(box.run(["sacctmgr", "-n", "-P", "show", "event", f"nodes={idle}",
                                "format=NodeName,Reason"]).stdout)

        text = wait_for(lambda: "XID 79" in (t := events()) and t, 90,
                        "our drain in sacctmgr show event")
        assert f"{idle}|SR: health: gpu1 XID 79" in str(text), text
    finally:
        faults.heal(box.state_dir, idle)
    hang_events = box.run(["sacctmgr", "-n", "-P", "show", "event", "format=NodeName,Reason",
                           "start=now-1hour"]).stdout
    print(hang_events)
    assert "SR: suspect hang job" in hang_events or "SR: hang job" in hang_events
