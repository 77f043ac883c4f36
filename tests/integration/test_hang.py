"""Hang detection end to end in the sandbox: real slurmctld/slurmd, one agent per node,
real PyTorch (gloo, CPU) training jobs run by unprivileged test users.

Figures (hang → requeue issued, hang → training running again) are printed;
run with ``-s`` to see them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hang_jobs import PYTHON, TRAIN, acting, output, reports, submit, wait_for, wait_for_decision

from slurm_resilience.heartbeat import paths as P
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(not TRAIN.exists(), reason="needs examples/train.py")]
STEP_TIMEOUT_S = 6.0  # sandbox heartbeat.step_timeout_s
CRED_EXPIRE_S = 10.0  # sandbox slurm.conf cred_expire


def test_hung_rank_is_detected_blamed_requeued_and_job_resumes(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """Rank 1 of a 2-node gloo job stops after step 12: detected and requeued (the times are
    printed), its node is a suspect (excluded from the job, verified, back in service), the
    report names it with a stack, and the job resumes and finishes."""
    user = test_users[0]
    work = sandbox.user_dir(user, "hang")
    job_id = submit(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                         "--hang-rank 1")
    wait_for_decision(sandbox, work, job_id)
    final = sandbox.wait_job(job_id, timeout=180)
    out = output(work, job_id)
    assert final.state == "COMPLETED", out
    assert re.search(r"done step=30 resumed_from=10 restarts=1", out), out

    report = acting(reports(sandbox, job_id), 0)
    assert report is not None
    hang_line = re.search(r"rank 1 hanging at step=12 at=([\d.]+)", out)
    node_line = re.search(r"rank 1 running step=1 at=[\d.]+ restarts=0 node=(\w+)", out)
    again = re.search(r"rank \d running step=\d+ at=([\d.]+) restarts=1", out)
    assert hang_line and node_line and again, out
    hang_at, stalled_node = float(hang_line.group(1)), node_line.group(1)
    # "Stalled first" is a heuristic: the node is a suspect, verified and back in service.
    assert report["blame"]["nodes"] == [stalled_node]  # type: ignore[index]
    assert [(c["node"], c["verdict"]) for c in report["decision"]["nodes"]] == [  # type: ignore[index]
        (stalled_node, "suspect")]
    assert stalled_node in sandbox.job(job_id).exc_nodes
    stacks = {r["rank"]: r["stack"] for ev in report["evidence"].values()  # type: ignore[union-attr]
              for r in ev["ranks"]}
    assert "main (" in stacks[1] and "torch/" not in stacks[1] and "torch/" in stacks[0]
    node = sandbox.adapter().show_node(stalled_node)
    assert not node.drained, node.reason

    detect_s = float(report["detected_at"]) - hang_at  # type: ignore[arg-type]
    requeue_s = float(report["timings"]["action_at"]) - hang_at  # type: ignore[index]
    running_s = float(again.group(1)) - hang_at
    print(f"\nhang -> detected {detect_s:.1f}s, -> requeue issued {requeue_s:.1f}s, "
          f"-> training running again {running_s:.1f}s (timeout {STEP_TIMEOUT_S:g}s, "
          f"cred_expire {CRED_EXPIRE_S:g}s; goal <= {STEP_TIMEOUT_S + CRED_EXPIRE_S + 15:g}s)")
    # The times are a reported figure, not a pass/fail bound (a loaded host stretches them):
    # what must hold is the order of events and the action taken.
    assert hang_at < float(report["timings"]["action_at"]) < float(again.group(1))  # type: ignore[index]
    assert report["decision"]["action"] == "requeue"  # type: ignore[index]


def test_xid_during_hang_blames_the_node_with_the_fresh_finding(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """An Xid 79 logged on rank 0's node during the hang outweighs "rank 1 stalled first": that
    node is drained with the Xid in the reason."""
    from slurm_resilience.sandbox import faults

    user = test_users[0]
    work = sandbox.user_dir(user, "xid")
    job_id = submit(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 8 "
                                          "--hang-rank 1")
    wait_for(lambda: "rank 1 hanging" in output(work, job_id), 90, "the hang")
    out = output(work, job_id)
    node_line = re.search(r"rank 0 running step=1 at=[\d.]+ restarts=0 node=(\w+)", out)
    assert node_line, out
    xid_node = node_line.group(1)
    try:
        print(faults.inject(sandbox.layout.state_dir, xid_node, "gpu-xid:5:79"))
        report = wait_for_decision(sandbox, work, job_id)
        calls = report["decision"]["nodes"]  # type: ignore[index]
        assert [(c["node"], c["verdict"]) for c in calls] == [(xid_node, "drain")], calls
        assert "XID 79" in calls[0]["reason"]
        assert report["blame"]["rule"] == "health"  # type: ignore[index]
        assert "XID 79" in sandbox.adapter().show_node(xid_node).reason
    finally:
        sandbox.run(["scancel", str(job_id)])
        faults.heal(sandbox.layout.state_dir, xid_node)  # the lost GPU would fail later prologs


def test_long_checkpoint_section_is_not_a_hang(sandbox: Sandbox,
                                               test_users: tuple[str, ...]) -> None:
    """A checkpoint section lasting twice the step timeout runs to the end: no incident."""
    user = test_users[0]
    work = sandbox.user_dir(user, "section")
    job_id = submit(sandbox, user, work, f"--steps 12 --ckpt-every 5 "
                                         f"--checkpoint-seconds {2 * STEP_TIMEOUT_S:g}")
    final = sandbox.wait_job(job_id, timeout=120)
    out = output(work, job_id)
    assert final.state == "COMPLETED" and final.restarts == 0, out
    assert "done step=12 resumed_from=0 restarts=0" in out
    assert reports(sandbox, job_id) == []


def test_hang_on_every_run_is_requeued_up_to_cap_then_held(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A job hanging on every run (with checkpoint progress) is requeued up to the cap (2
    here: the count carries over a requeue), then held with the reason in AdminComment and
    in `slurm-resilience status`. (Cap 1 end to end: test_hang_policy.py.)"""
    sandbox.update_resilience_config({"heartbeat": {"max_requeues": 2}})
    user = test_users[0]
    work = sandbox.user_dir(user, "cap")
    job_id = submit(sandbox, user, work, "--steps 100 --ckpt-every 1 --hang-after 4 "
                                         "--hang-rank 1 --fault-every-run", nodes=1, tasks=2)
    # No wait for a first PENDING: a submitted job is PENDING at once, and later, between a
    # requeue's COMPLETING and its next start, for as long as the epilog takes under load.
    deadline = time.monotonic() + 300
    held = sandbox.job(job_id)
    while time.monotonic() < deadline:
        held = sandbox.job(job_id)
        if held.state == "PENDING" and "held after" in held.admin_comment:
            break
        time.sleep(1)
    assert "held after 2 hang requeues (cap 2)" in held.admin_comment, held
    assert held.restarts == 3 and "[sr-hang n=2" in held.admin_comment
    status = subprocess.run(
        [str(PYTHON), "-m", "slurm_resilience", "--config", str(sandbox.layout.resilience_conf),
         "status", "--json"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "SLURM_CONF": str(sandbox.layout.slurm_conf)})
    jobs = {j["job_id"]: j for j in json.loads(status.stdout)["jobs"]}
    assert jobs[job_id]["held"] is True and jobs[job_id]["hang_requeues"] == 2
    actions = [r["decision"]["action"] for r in reports(sandbox, job_id)  # type: ignore[index]
               if r["decision"]["action"] in ("requeue", "hold")]  # type: ignore[index]
    assert sorted(actions) == ["hold", "requeue", "requeue"]


def test_other_user_cannot_beat_into_or_act_on_a_job(sandbox: Sandbox,
                                                     test_users: tuple[str, ...]) -> None:
    """Another user can neither open the job's slots nor create one, nor report or see the job
    through the agent; the owner can."""
    owner, intruder = test_users
    work = sandbox.user_dir(owner, "sec")
    job_id = submit(sandbox, owner, work, "--steps 400 --step-seconds 0.2", nodes=1, tasks=1)
    job = sandbox.wait_job(job_id, states={"RUNNING"}, timeout=60)
    node = job.nodes[0]
    run_dir = str(sandbox.node_dir(node) / "run")
    slot = Path(P.job_dir(run_dir, node, job_id)) / "hb-rank-0.slot"
    wait_for(slot.exists, 60, "the job's heartbeat slot")
    probe = (
        "import sys\n"
        "from slurm_resilience.agent import client\n"
        "try:\n"
        f"    open({str(slot)!r}, 'r+b')\n"
        "    print('OPENED')\n"
        "except OSError as e:\n"
        "    print('open refused:', e.strerror)\n"
        "try:\n"
        f"    open({str(slot.parent / 'hb-rank-5.slot')!r}, 'wb')\n"
        "    print('CREATED')\n"
        "except OSError as e:\n"
        "    print('create refused:', e.strerror)\n"
        "try:\n"
        f"    client.call(sys.argv[1], 'hang.report', job_id={job_id})\n"
        "    print('REPORTED')\n"
        "except client.AgentRefused as e:\n"
        "    print('report refused:', e)\n"
        "print('status jobs:', [j['job_id'] for j in client.call(sys.argv[1], "
        "'hang.status')['jobs']])\n")
    sock = _agent_socket(sandbox, node)
    out = sandbox.run([str(PYTHON), "-c", probe, sock], user=intruder, timeout=30).stdout
    assert "open refused: Permission denied" in out, out
    assert "create refused: Permission denied" in out, out
    assert f"report refused: no job {job_id} of uid " in out, out
    assert "status jobs: []" in out, out
    mine = sandbox.run([str(PYTHON), "-c", "import sys\nfrom slurm_resilience.agent import "
                        "client\nprint([j['job_id'] for j in client.call(sys.argv[1], "
                        "'hang.status')['jobs']])", sock], user=owner, timeout=30).stdout
    assert str(job_id) in mine
    sandbox.run(["scancel", str(job_id)])


def _agent_socket(sandbox: Sandbox, node: str) -> str:
    import yaml

    conf = yaml.safe_load(sandbox.layout.resilience_conf.read_text())
    template = conf.get("agent", {}).get("socket", "/run/slurm-resilience/agent.sock")
    return str(template.replace("{node}", node))


def test_observe_mode_reports_but_does_not_act(sandbox: Sandbox,
                                               test_users: tuple[str, ...]) -> None:
    """With heartbeat.mode observe the hang is reported, and nothing is drained or requeued."""
    sandbox.update_resilience_config({"heartbeat": {"mode": "observe"}})
    time.sleep(2)  # agents pick the change up on their next tick
    user = test_users[0]
    work = sandbox.user_dir(user, "observe")
    job_id = submit(sandbox, user, work, "--steps 30 --hang-at-step 8 --hang-rank 1")
    found = wait_for(lambda: [r for r in reports(sandbox, job_id) if "blame" in r], 90,
                     "the batch host's observe report")
    assert [r["decision"]["action"] for r in found] == ["report"]  # type: ignore[index,union-attr]
    job = sandbox.job(job_id)
    assert job.state == "RUNNING" and job.restarts == 0 and "[sr-hang" not in job.admin_comment
    assert not [n for n in sandbox.adapter().list_nodes() if n.drained]
    sandbox.run(["scancel", str(job_id)])


def test_per_job_opt_out_reports_but_does_not_act(sandbox: Sandbox,
                                                  test_users: tuple[str, ...]) -> None:
    """A job with SLURM_RESILIENCE_HANG=observe is reported when it hangs, never requeued."""
    user = test_users[0]
    work = sandbox.user_dir(user, "optout")
    job_id = submit(sandbox, user, work, "--steps 30 --hang-at-step 8 --hang-rank 1",
                    extra_env="export SLURM_RESILIENCE_HANG=observe\n")
    found = wait_for(lambda: [r for r in reports(sandbox, job_id) if "blame" in r], 90,
                     "the batch host's report")
    assert [r["mode"] for r in found] == ["observe"]  # type: ignore[index]
    assert [r["decision"]["action"] for r in found] == ["report"]  # type: ignore[index,union-attr]
    job = sandbox.job(job_id)
    assert job.state == "RUNNING" and job.restarts == 0
    assert not [n for n in sandbox.adapter().list_nodes() if n.drained]
    sandbox.run(["scancel", str(job_id)])


if __name__ == "__main__":  # pragma: no cover - convenience
    sys.exit(pytest.main([__file__, "-s", "-q"]))
