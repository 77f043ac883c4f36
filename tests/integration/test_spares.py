"""Hot spares end to end in the sandbox: ``slurm-resilience launch --spares`` in the batch
script of a real job, real slurmctld/slurmd, one agent per node, real PyTorch (gloo, CPU)
ranks of an unprivileged test user.

The figures (hang -> relaunch ordered, hang -> training running again) are printed; run
with ``-s`` to see them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from hang_jobs import (
    PYTHON,
    TRAIN,
    acting,
    goodput,
    output,
    reports,
    step_nodes,
    submit_launch,
    wait_for,
    wait_for_decision,
    wait_for_output,
)

from slurm_resilience.launch.cli import nodes_seen
from slurm_resilience.launch.returning import Seen
from slurm_resilience.sandbox import faults, nodekill
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(not TRAIN.exists(), reason="needs examples/train.py")]


def _node_of(out: str, rank: int, restarts: int) -> str:
    m = re.search(rf"rank {rank} running step=\d+ at=[\d.]+ restarts={restarts} node=(\w+)",
                  out)
    assert m, out
    return m.group(1)


def test_hang_is_relaunched_on_the_spare_inside_the_allocation(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A 2-node job with one spare (3-node allocation): rank 1 wedges at step 12. The batch
    host's agent takes rank 1's node out (a suspect), the launcher ends the step and starts
    it on the survivor plus the spare; the job is never requeued (Restarts=0), resumes from
    step 10 (the newest committed) and finishes; the suspect is verified and returned once
    the job has left it."""
    user = test_users[0]
    work = sandbox.user_dir(user, "spare")
    job_id = submit_launch(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                                "--hang-rank 1")
    running = sandbox.wait_job(job_id, states={"RUNNING"}, timeout=120)
    assert len(running.nodes) == 3, running
    wait_for_decision(sandbox, work, job_id)
    final = sandbox.wait_job(job_id, timeout=240)
    report = acting(reports(sandbox, job_id), 0)  # the final copy, with the action's time
    assert report is not None
    out = output(work, job_id)
    assert report["decision"]["action"] == "relaunch", report  # type: ignore[index]
    assert final.state == "COMPLETED" and final.restarts == 0, (final, out)
    assert re.search(r"done step=30 resumed_from=10 restarts=1 ", out), out

    hung = _node_of(out, 1, 0)
    survivor = _node_of(out, 0, 0)
    spare = (set(running.nodes) - {hung, survivor}).pop()
    assert _node_of(out, 1, 1) == spare and _node_of(out, 0, 1) == survivor, out
    assert [(c["node"], c["verdict"]) for c in report["decision"]["nodes"]] == [  # type: ignore[index]
        (hung, "suspect")]
    assert f"relaunch 1: {survivor} {spare} at=" in out, out
    # Survivors read their own copy; the spare's share came through its agent (S3).
    assert "joined the step at a relaunch" in out or "committed in S3" in out or \
        "resumed_from=10" in out
    # Handled as today: verified once the job left it, then back in service.
    wait_for(lambda: not sandbox.adapter().show_node(hung).drained, 180,
             "the suspect's return to service")
    hang_at = float(re.search(r"rank 1 hanging at step=12 at=([\d.]+)", out).group(1))  # type: ignore[union-attr]
    again = float(re.search(r"rank \d running step=\d+ at=([\d.]+) restarts=1", out).group(1))  # type: ignore[union-attr]
    ordered = float(report["timings"]["action_at"])  # type: ignore[index]
    print(f"\nspare path: hang -> relaunch ordered {ordered - hang_at:.1f}s, -> training "
          f"running again {again - hang_at:.1f}s")
    assert hang_at < ordered < again
    # Goodput counts the allocation once: the relaunch starts where run 0 ended (after the
    # order), not at the job's start where each node's record of it begins.
    g = goodput(sandbox, job_id, list(running.nodes))
    assert [(r["restarts"], r["relaunch"]) for r in g["runs"]] == [(0, 0), (0, 1)], g
    done = float(re.search(r"done step=30 resumed_from=10 restarts=1 at=([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # Counted from the job's start, the relaunch would span at least from the first rank's
    # start to done; from run 0's end it spans done - ordered plus the tail after done (the
    # last commit, the exit, the epilog: seconds, more on a loaded machine), less than the
    # run 0 ranks' time from their start to the order (start-up, 12 steps, detection).
    first = min(float(t) for t in re.findall(r"rank \d+ started at=([\d.]+)", out))
    assert g["runs"][1]["allocated_s"] < done - first, (g, done - ordered, done - first)


def test_a_suspect_verified_while_the_job_holds_it_is_a_spare_again(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """Rank 1 hangs (when a file the test creates exists): its node is taken out as a
    suspect and the step relaunched on the spare. The suspect's own agent verifies it while
    the job still holds it (no step of the job runs there) and returns it, the launcher
    has it as a spare again, and a second hang is relaunched onto it: no requeue."""
    user = test_users[0]
    work = sandbox.user_dir(user, "returned")
    trigger = work / "hang-now"
    job_id = submit_launch(sandbox, user, work, "--steps 5000 --ckpt-every 5 --hang-rank 1 "
                                                f"--fault-every-run --hang-on-file {trigger}",
                           launch_args="--return-poll 1")

    def hang_once(run: int) -> None:
        # After a commit of this run (the hang timeout before the first one is longer).
        this_run = rf"rank 1 running step=\d+ at=[\d.]+ restarts={run} [\s\S]*"
        wait_for_output(sandbox, work, job_id, this_run + r"checkpoint step=\d+", 300,
                        f"run {run}'s first checkpoint")
        trigger.touch()
        wait_for_output(sandbox, work, job_id, this_run + r"rank 1 hanging at step=", 120,
                        f"run {run}'s hang")
        trigger.unlink()  # the rank is stuck for good; the next run must not hang at once

    try:
        hang_once(0)
        first = _node_of(output(work, job_id), 1, 0)
        wait_for_output(sandbox, work, job_id, rf"{first} back in service: a spare again",
                        300, "the suspect back as a spare")
        assert not sandbox.adapter().show_node(first).drained
        hang_once(1)
        wait_for_output(sandbox, work, job_id, r"rank 1 running step=\d+ at=[\d.]+ "
                                               r"restarts=2 ", 300, "the second relaunch")
        out = output(work, job_id)
        assert _node_of(out, 1, 2) == first, out
        assert sandbox.job(job_id).restarts == 0
    finally:
        sandbox.run(["scancel", str(job_id)], check=False)


def test_without_a_spare_the_job_is_requeued_as_before(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """``--spares 0``: the blamed node can't be replaced inside the allocation, so the agent
    requeues the job as it does without a launcher; the requeued script launches again and
    the job finishes from its checkpoint."""
    user = test_users[0]
    work = sandbox.user_dir(user, "nospare")
    job_id = submit_launch(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                                "--hang-rank 1", nodes=2, spares=0)
    report = wait_for_decision(sandbox, work, job_id)
    final = sandbox.wait_job(job_id, timeout=240)
    out = output(work, job_id)
    assert report["decision"]["action"] == "requeue", report  # type: ignore[index]
    assert "no usable spare" in report["decision"]["reason"], report  # type: ignore[index]
    assert final.state == "COMPLETED" and final.restarts == 1, (final, out)
    assert re.search(r"done step=30 resumed_from=10 restarts=1 ", out), out


def test_a_spare_that_fails_the_gate_is_not_used(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """The spare loses a GPU (Xid 79) while it waits: the idle health check drains it, so
    the hang is not relaunched on it; the job takes the requeue path, and the report says
    why the spare was not used."""
    user = test_users[0]
    work = sandbox.user_dir(user, "badspare")
    trigger = work / "hang-now"
    job_id = submit_launch(sandbox, user, work, f"--steps 100000 --ckpt-every 5 --hang-rank 1 "
                                                f"--hang-on-file {trigger}")
    running = sandbox.wait_job(job_id, states={"RUNNING"}, timeout=120)
    out = wait_for(lambda: re.search(r"relaunch 0: \S+ \S+ \(spares (\S+)\) at=",
                                     output(work, job_id)), 120, "the launcher's first line")
    spare = out.group(1)
    assert spare in running.nodes
    try:
        faults.inject(sandbox.layout.state_dir, spare, "gpu-xid:3:79")
        wait_for(lambda: sandbox.adapter().show_node(spare).drained, 120, "the spare drained")
        # How the launcher sees nodes waiting to be spares again (launch/returning.py).
        step_node = next(n for n in running.nodes if n != spare)
        outside = next(n for n in sandbox.nodes if n not in running.nodes)
        assert nodes_seen(sandbox.adapter(), job_id, [spare, step_node, outside]) == {
            spare: Seen.OUT, step_node: Seen.IN_SERVICE, outside: Seen.LEFT_JOB}
        trigger.write_text("")  # only now: the gate has spoken before the hang
        report = wait_for_decision(sandbox, work, job_id)
        assert report["decision"]["action"] == "requeue", report  # type: ignore[index]
        assert f"spare {spare} not used" in report["decision"]["reason"], report
    finally:
        sandbox.run(["scancel", str(job_id)])
        faults.heal(sandbox.layout.state_dir, spare)


def test_an_xid_that_kills_a_step_nodes_ranks_relaunches_on_the_spare_at_once(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A GPU of a step node falls off the bus (Xid 79) and its rank dies with it. That
    node's agent sees the rank die and runs the node's HealthCheckProgram at once
    (hang/deathcheck.py), not at Slurm's next HealthCheckInterval: the gate drains the node
    with the Xid as its reason, and the launcher's question about the failed step gets a
    relaunch on the survivor plus the spare, inside the allocation (Restarts=0).

    The job saves at the fault (SLURM_RESILIENCE_CKPT_RESCUE=on): the survivor's all-reduce
    raises when its peer dies, and as the exception leaves the script its last finished
    step is saved; the relaunch resumes from that step, the spare getting it from the
    survivor, not from the last checkpoint."""
    user = test_users[0]
    work = sandbox.user_dir(user, "xidstep")
    job_id = submit_launch(sandbox, user, work, "--steps 100000 --ckpt-every 5",
                           exports=(("SLURM_RESILIENCE_CKPT_RESCUE", "on"),))
    _host, other = step_nodes(sandbox, work, job_id)
    wait_for_output(sandbox, work, job_id, r"checkpoint step=5 ", 240, "the first checkpoint")
    _past_the_death_check_throttle(sandbox, other)
    try:
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())  # the log's UTC stamps
        faults.inject(sandbox.layout.state_dir, other, "gpu-xid:0:79")
        killed = [pid for pid in nodekill.node_processes(sandbox.layout, other)
                  if b"train.py" in _cmdline(pid)]
        assert killed, f"no rank of job {job_id} on {other}"
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for_output(sandbox, work, job_id, r"rank \d+ running step=\d+ at=\S+ restarts=1 ",
                        240, "the relaunched step")
        out = output(work, job_id)
        assert re.search(rf"incident: node fault in job {job_id} \({other} drained \(SR: "
                         r"health: gpu0 XID 79", out), out
        assert other not in re.findall(r"relaunch 1: (.*) at=", out)[0].split(), out
        assert sandbox.job(job_id).restarts == 0
        saved = re.search(r"checkpoint: rescue: saved step (\d+) at the fault \(the training "
                          r"raised", out)
        assert saved, out
        step = int(saved.group(1))
        spare = re.findall(r"relaunch 1: (.*) at=", out)[0].split()[-1]
        assert f"resuming from step {step}, saved at the fault by 1 rank(s); sent to " \
               f"{spare}" in out, out
        assert re.search(rf"rank \d+ running step={step + 1} at=\S+ restarts=1 ", out), out
        # The node's own agent ran the gate when the rank died, and the node was drained no
        # later than that run's end (the periodic HealthCheckProgram may come first).
        events = [json.loads(line) for line in
                  (sandbox.layout.log_dir / "slurm-resilience.jsonl").read_text().splitlines()
                  if f'"{other}"' in line]
        ran = [e["timestamp"] for e in events if e["event"] == "HealthCheckProgram finished "
               "after a rank died" and e.get("job_id") == job_id]
        drained = [e["timestamp"] for e in events if e["event"] == "node drained"
                   and "XID 79" in str(e.get("reason")) and e["timestamp"] >= since]
        assert ran and drained and drained[0] <= ran[0], (ran, drained)
    finally:
        sandbox.run(["scancel", str(job_id)], check=False)
        faults.heal(sandbox.layout.state_dir, other)
        sandbox.run(["scontrol", "update", f"NodeName={other}", "State=RESUME"], check=False)


def _past_the_death_check_throttle(sandbox: Sandbox, node: str) -> None:
    """A node runs its gate after a rank death at most once per check_on_rank_death_s (30 s):
    an earlier test's relaunch that killed ranks there must be that far behind, or this
    death finds the gate throttled (seen when this test ran right after the hang test)."""
    from slurm_resilience import config

    every = config.load(str(sandbox.resilience_config)).health.check_on_rank_death_s
    log = sandbox.layout.log_dir / "slurm-resilience.jsonl"
    ran = [e["timestamp"] for e in (json.loads(line) for line in log.read_text().splitlines()
                                    if f'"{node}"' in line)
           if str(e.get("event", "")).startswith("a job's rank died here: running")]
    if ran:
        last = datetime.datetime.fromisoformat(ran[-1].replace("Z", "+00:00")).timestamp()
        time.sleep(max(0.0, last + every + 1 - time.time()))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# Each task runs torchrun with one worker; the static rendezvous's port is the job's, the
# cluster's and the relaunch's (a relaunched step must not meet the old one's store).
TORCHRUN_WRAPPER = """#!/bin/sh
port=$({python} -c 'import os, zlib; e = os.environ; print(20000 + zlib.crc32("/".join(
    [e.get("SLURM_CLUSTER_NAME", ""), e["SLURM_JOB_ID"], e["SLURM_RESILIENCE_RELAUNCH"],
     "torchrun"]).encode()) % 12000)')
exec {torchrun} --nnodes="$SLURM_NNODES" --nproc-per-node=1 --node-rank="$SLURM_NODEID" \\
    --master-addr=127.0.0.1 --master-port="$port" "$@"
"""


def test_srun_torchrun_under_launch_is_relaunched_on_the_spare(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """``launch -- torchrun ...``: torchrun's workers are the ranks; a hung worker is
    relaunched on the spare with a fresh torchrun rendezvous, and the job finishes from
    step 10 without a requeue."""
    user = test_users[0]
    work = sandbox.user_dir(user, "torchrun")
    wrapper = work / "torchrun.sh"
    wrapper.write_text(TORCHRUN_WRAPPER.format(python=PYTHON,
                                               torchrun=PYTHON.parent / "torchrun"))
    wrapper.chmod(0o755)
    job_id = submit_launch(sandbox, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                                "--hang-rank 1", runner=str(wrapper))
    report = wait_for_decision(sandbox, work, job_id)
    final = sandbox.wait_job(job_id, timeout=300)
    out = output(work, job_id)
    assert report["decision"]["action"] == "relaunch", (report, out)
    assert final.state == "COMPLETED" and final.restarts == 0, (final, out)
    assert re.search(r"done step=30 resumed_from=10 restarts=1 ", out), out
