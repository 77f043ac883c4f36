"""Buddy copies in the sandbox (Slurm 22.05, real agents, munge, rclone, PyTorch on CPU):
a node lost after its local commit but before its upload, with S3 down, still resumes
from that newest step, because the next node of the job holds a verified copy of its part.

One job under ``slurm-resilience launch --spares 1`` on 3 nodes (2 step nodes and the
spare). Once step 50 is in S3 the S3 endpoint is stopped; step 100 is then committed on
both step nodes and can't be uploaded, and the lost node's part of it reaches its buddy
(the next node of the job's sorted node list); then every process of that step node is
killed. The job relaunches on the survivor plus the spare and must resume from step 100
with S3 still down (the spare stages it in from the job's nodes, and both nodes fetch the
lost node's part from its buddy), then finish. S3 comes back only after the resume.
"""

from __future__ import annotations

import json
import re
import time
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
    wait_for_output,
)

from slurm_resilience import events
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.nodekill import kill_node, revive_node
from slurm_resilience.uploader.buddy_ring import buddy_of

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(not TRAIN.exists(), reason="needs examples/train.py")]

# 15 s between checkpoints: the lost node's copy of step 100 lands (and the node is killed)
# well before step 150, the last, could commit.
TRAIN_ARGS = "--steps 150 --ckpt-every 50 --step-seconds 0.3"


def _staging(box: Sandbox, node: str) -> Path:
    return box.layout.nodes_dir / node / "nvme"


def _log_lines(box: Sandbox, text: str) -> list[str]:
    return [ln for f in box.layout.log_dir.glob("*.*") if f.is_file()
            for ln in f.read_text(errors="replace").splitlines() if text in ln]


def test_a_node_lost_before_its_upload_resumes_from_its_buddys_copy_with_s3_down(
        sandbox_factory: Callable[..., Sandbox], test_users: tuple[str, ...]) -> None:
    box = sandbox_factory(nodes=3, leaves=1)
    box.update_resilience_config({"checkpoint": {"buddy_copies": True}})
    user = test_users[0]
    work = box.user_dir(user, "buddy")
    job_id = submit_launch(box, user, work, TRAIN_ARGS, sbatch_args=("--no-kill",))
    running = box.wait_job(job_id, states={"RUNNING"}, timeout=120)
    nodes = tuple(running.nodes)
    assert len(nodes) == 3, running
    host, lost = step_nodes(box, work, job_id)
    holder = buddy_of(lost, nodes)
    assert holder is not None and holder != lost
    spare = (set(nodes) - {lost, host}).pop()
    wait_for(lambda: 50 in committed_in_s3(box, user, work), 240, "step 50 committed in S3")

    with s3_stopped(box):
        # Step 100 committed on the node to be lost, and its verified copy on its buddy.
        mine = _staging(box, lost) / f"job-{job_id}" / "step-00000100" / "COMMIT.json"
        copy = (_staging(box, holder) / ".buddy" / f"job-{job_id}" / f"from-{lost}"
                / "step-00000100" / "COMMIT.json")
        wait_for(lambda: mine.exists(), 240, f"step 100 committed on {lost}")
        started = time.monotonic()
        wait_for(lambda: copy.exists(), 120, f"{lost}'s copy of step 100 on {holder}")
        copied_s = time.monotonic() - started
        assert 100 not in committed_in_s3(box, user, work)
        assert kill_node(box.layout, lost), f"nothing of {lost} was running"

        # The relaunched ranks' first line, with S3 still down (or the job's end).
        seen = wait_for_output(box, work, job_id, r"rank \d+ running step=(\d+) at=\S+ "
                               r"restarts=1 ", 420, "the relaunched step's resume")
        out = output(work, job_id)
        assert f"node {lost} lost: relaunch 1 on" in out, out
        resumed = int(seen.group(1)) - 1
    final = box.wait_job(job_id, timeout=420)
    out = output(work, job_id)
    assert final.state == "COMPLETED" and final.restarts == 0, (final, out)
    # The step committed before the kill, never an older one.
    assert resumed == 100, out
    assert re.search(r"done step=150 resumed_from=100 restarts=1 ", out), out
    # The node-loss path (this test is also its sandbox case with a spare): the launcher's
    # line, the lost node DOWN, the decision counted once and named in the agent's log
    # (Slurm refuses AdminComment updates of a job it resized when there is no accounting,
    # as in this sandbox).
    assert f"slurm-resilience launch: node {lost} lost: relaunch 1 on {host} {spare}" in out, \
        out
    assert counted(box, events.NODE_LOSS, "relaunch") == 1
    ordered = _log_lines(box, "node lost: relaunch ordered")
    assert ordered and all(lost in ln for ln in ordered), ordered
    # Found lost by the batch host's probes (its slurmd and agent gone for
    # heartbeat.node_unreachable_s), not after Slurm's SlurmdTimeout; Slurm marks it later.
    assert all(f"{lost} unreachable for " in ln for ln in ordered), ordered
    wait_for(lambda: box.adapter().show_node(lost).down, 120, f"Slurm marks {lost} down")
    # The lost node's part came from its buddy: said in the agents' logs, and counted.
    staged = _log_lines(box, "buddy: stage-in took the step from the job's nodes")
    assert any(f"buddy on {holder}" in ln for ln in staged), staged
    used = _log_lines(box, "buddy: a restore used a buddy copy")
    assert used and all(lost in ln for ln in used), used
    assert counted(box, events.BUDDY, "used") >= 1
    assert counted(box, events.BUDDY, "received") >= 1
    sent = [json.loads(ln) for ln in _log_lines(box, "buddy: sent this node's part")
            if ln.startswith("{")]
    mine = [e for e in sent if e.get("node") == lost and e.get("step") == 100]
    assert mine, sent
    rate = mine[0]["bytes"] / max(mine[0]["seconds"], 1e-3)
    print(f"\nbuddy copy of step 100: {mine[0]['bytes']:,} bytes from {lost} to {holder} in "
          f"{mine[0]['seconds']:.2f}s ({mine[0]['messages']} messages, {rate / 1e6:.2f} MB/s; "
          f"seen {copied_s:.1f}s after the commit was seen); spare {spare}; resumed from "
          f"step {resumed}")
    # Its slurmd and agent started again, Slurm takes it back (ReturnToService=2).
    revive_node(box.layout, lost)
    wait_for(lambda: not box.adapter().show_node(lost).down, 120, f"{lost} back in service")
