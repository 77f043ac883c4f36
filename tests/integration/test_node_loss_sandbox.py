"""A node lost under ``slurm-resilience launch`` (Slurm 22.05 here): every process of one
step node is SIGKILLed (its slurmd, slurmstepds, tasks and agent), as a power cut would.
The step fails as the survivor's collective does; the batch host's agent finds the node's
slurmd and agent gone for ``heartbeat.node_unreachable_s`` (5 s), well before Slurm's
missed pings (SlurmdTimeout 30 s in the sandbox) mark it, and relaunches the step on the
survivor plus the spare
inside the allocation (``sbatch --no-kill``), or, without a spare, requeues the job away
from the lost node; the survivor then uploads the lost node's part of the newest step from
its buddy copy, so the requeued run finds that step whole in S3. Each test runs in a
sandbox of its own: a lost node is not put back for the next test. The case with a spare
is tests/integration/test_buddy_sandbox.py: the node is lost with S3 down, so the spare
path also restores through the buddy copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hang_jobs import (
    TRAIN,
    committed_in_s3,
    counted,
    output,
    s3_stopped,
    step_nodes,
    submit_launch,
    wait_for,
)

from slurm_resilience import events
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.nodekill import kill_node

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(not TRAIN.exists(), reason="needs examples/train.py")]

# Long enough that a step is committed in S3 well before the end; a checkpoint every 25
# steps leaves seconds between commits to lose the node right after one.
TRAIN_ARGS = "--steps 100 --ckpt-every 25 --step-seconds 0.3"


def _lose_a_step_node(box: Sandbox, user: str, work: Path, job_id: int,
                      batch_host: bool = False) -> tuple[str, str]:
    """Wait for the launcher's first line and step 25 committed in S3, then kill the step
    node that is not the batch host (or the batch host): (the lost node, the batch host)."""
    host, other = step_nodes(box, work, job_id)
    lost = host if batch_host else other
    wait_for(lambda: 25 in committed_in_s3(box, user, work), 240, "step 25 committed in S3")
    killed = kill_node(box.layout, lost)
    assert killed, f"nothing of {lost} was running"
    return lost, host


def test_without_a_spare_a_lost_node_requeues_the_job_away_and_its_buddy_uploads_its_part(
        sandbox_factory: Callable[..., Sandbox], test_users: tuple[str, ...]) -> None:
    """``--spares 0`` on 2 of 4 nodes, ``--no-kill``, buddy copies on. S3 is down when step
    50 commits, so the node to be lost keeps its part of it, and the other step node (its
    buddy) a verified copy. The node is lost and S3 returns. The lost node can't be
    replaced in the allocation, so the agent requeues the job with the node excluded (the
    node-fault requeue); the survivor, drained by the test, is left out of the requeued run
    too, so only S3 can give step 50. Once the job has left the survivor, its agent uploads
    the lost node's part from the copy, the step commits, and the requeued run resumes from
    step 50 on the two other nodes."""
    box = sandbox_factory(nodes=4, leaves=1)
    # The requeued run's stage-in waits for the announced step 50 while the survivor's
    # epilog ends the job there and its agent uploads the part (seconds; the bound is for
    # a loaded machine).
    box.update_resilience_config({"checkpoint": {"buddy_copies": True,
                                                 "stagein_intent_wait_s": 180.0}})
    user = test_users[0]
    work = box.user_dir(user, "lost-nospare")
    job_id = submit_launch(box, user, work, TRAIN_ARGS, nodes=2, spares=0,
                           sbatch_args=("--no-kill",))
    box.wait_job(job_id, states={"RUNNING"}, timeout=120)
    survivor, lost = step_nodes(box, work, job_id)
    wait_for(lambda: 25 in committed_in_s3(box, user, work), 240, "step 25 committed in S3")
    with s3_stopped(box):
        mine = box.layout.nodes_dir / lost / "nvme" / f"job-{job_id}" / "step-00000050"
        copy = (box.layout.nodes_dir / survivor / "nvme" / ".buddy" / f"job-{job_id}"
                / f"from-{lost}" / "step-00000050" / "COMMIT.json")
        wait_for(lambda: (mine / "COMMIT.json").exists(), 240, f"step 50 committed on {lost}")
        wait_for(lambda: copy.exists(), 120, f"{lost}'s copy of step 50 on {survivor}")
        assert kill_node(box.layout, lost), f"nothing of {lost} was running"
        # A site's own drain (not ours: no "SR:"), so the survivor is not taken for lost.
        box.run(["scontrol", "update", f"nodename={survivor}", "state=drain",
                 "reason=site maintenance"])
    final = box.wait_job(job_id, timeout=480)
    out = output(work, job_id)
    assert final.state == "COMPLETED" and final.restarts == 1, (final, out)
    assert lost in final.exc_nodes and lost not in final.nodes, final
    assert survivor not in final.nodes, final
    # The launcher may be ended by the requeue before it prints the agent's answer.
    assert f"node fault on {lost}: " in final.admin_comment, final.admin_comment
    assert f"{lost} unreachable for " in final.admin_comment, final.admin_comment
    assert "no usable spare" in final.admin_comment, final.admin_comment
    assert re.search(r"done step=100 resumed_from=50 restarts=1 ", out), out
    assert "[sr-fault n=1 " in final.admin_comment, final.admin_comment
    wait_for(lambda: box.adapter().show_node(lost).down, 120, f"Slurm marks {lost} down")
    assert counted(box, events.NODE_LOSS, "requeue") == 1
    # Step 50 reached S3 whole through the survivor's hand-off, said and counted there.
    assert 50 in committed_in_s3(box, user, work)
    assert counted(box, events.BUDDY, "uploaded") == 1
    said = [json.loads(ln) for ln in (box.layout.log_dir / "slurm-resilience.jsonl").read_text(
        errors="replace").splitlines() if "buddy: uploaded a node's part" in ln]
    assert [(e.get("node"), e["source"], e["step"]) for e in said] == [(survivor, lost, 50)], said
    # The job was released only once the survivor had announced step 50 in S3 (after the
    # outage its uploads backed off): the requeued run's stage-in waited for that step.
    announced = [json.loads(ln) for ln in (box.layout.log_dir / "slurm-resilience.jsonl")
                 .read_text(errors="replace").splitlines()
                 if "announced in S3 before the job's requeue" in ln]
    assert [(e.get("node"), e["step"]) for e in announced] == [(survivor, 50)], announced


def test_a_lost_batch_host_requeues_the_job_from_its_first_survivor(
        sandbox_factory: Callable[..., Sandbox], test_users: tuple[str, ...]) -> None:
    """The batch host itself is lost under ``--no-kill``: Slurm 22.05 removes it from the
    job, which stays RUNNING on the other node without its script (and its launcher and
    deciding agent). The other node's agent requeues it away from the lost host; the
    requeued run resumes from its checkpoint and completes."""
    box = sandbox_factory(nodes=3, leaves=1)
    user = test_users[0]
    work = box.user_dir(user, "lost-host")
    job_id = submit_launch(box, user, work, TRAIN_ARGS, nodes=2, spares=0,
                           sbatch_args=("--no-kill",))
    box.wait_job(job_id, states={"RUNNING"}, timeout=120)
    lost, host = _lose_a_step_node(box, user, work, job_id, batch_host=True)
    assert lost == host
    final = box.wait_job(job_id, timeout=420)
    out = output(work, job_id)
    assert final.state == "COMPLETED" and final.restarts == 1, (final, out)
    assert lost in final.exc_nodes and lost not in final.nodes, final
    assert f"node fault on {lost}: the batch host was lost" in final.admin_comment, \
        final.admin_comment
    done = re.search(r"done step=100 resumed_from=(\d+) restarts=1 ", out)
    assert done and int(done.group(1)) >= 25, out
    assert counted(box, events.NODE_LOSS, "requeue") == 1
