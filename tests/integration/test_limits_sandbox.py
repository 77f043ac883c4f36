"""Every interruption continues the run: a job with a one-minute time limit is warned by
its nodes' agents ahead of it, every rank saves the same step at the next step boundary,
the job is requeued and resumes from that step, as often as it takes to finish. Real
slurmctld/slurmd, real PyTorch (gloo, CPU) jobs of an unprivileged user."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hang_jobs import (
    PYTHON,
    TRAIN,
    counted,
    goodput,
    output,
    submit,
    wait_for,
    wait_for_output,
)

from slurm_resilience import events
from slurm_resilience.hang.limits import planned_count
from slurm_resilience.hang.requeue import parse_ledger
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(not TRAIN.exists(), reason="needs examples/train.py")]
# 30 s of steps: more than any one-minute run leaves before its warning (the sandbox warns
# 35 s ahead), so every job meets its limit at least once whatever the load.
STEPS = 60
TORCHRUN = PYTHON.parent / "torchrun"


def check_planned_restarts(box: Sandbox, job_id: int, out: str) -> list[tuple[int, int]]:
    """Each run that stopped saved step S and the next run resumed from S; returns
    (run, S) per stop."""
    # A run the warning missed (a step slower than the lead) saved at the limit's SIGTERM,
    # taking it for a preemption; the agent saw the limit and requeued it all the same.
    stops = [(int(m.group(1)), int(m.group(2).replace(",", ""))) for m in re.finditer(
        r"stopped step=(\d+) cause=\w+ at=[\d.]+: time limit (?:in \d+ s|reached): saved "
        r"step ([\d,]+), requeued", out)]
    runs = sorted({int(r) for r in re.findall(r"rank 0 running step=\d+ at=[\d.]+ restarts=(\d+)",
                                              out)})
    assert stops, out
    assert len(runs) == len(stops) + 1, out
    for run, (stopped, saved) in zip(runs[:-1], stops, strict=True):
        assert stopped == saved
        # The next run starts at the step after the saved one: nothing done was lost.
        assert re.search(rf"rank 0 running step={saved + 1} at=[\d.]+ restarts={run + 1} ",
                         out), out
    assert re.search(rf"done step={STEPS} resumed_from={stops[-1][1]} restarts={runs[-1]}",
                     out), out
    assert re.search(r"slurm-resilience: time limit in \d+ s: saved step [\d,]+, requeued",
                     out), out
    return [(run, saved) for run, (_, saved) in zip(runs[:-1], stops, strict=True)]


def limits_log(sandbox: Sandbox) -> str:
    """The agents' warnings and stops, and their slow ticks, from the sandbox's log."""
    path = sandbox.state_dir / "log" / "slurm-resilience.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return "\n".join(line for line in lines
                     if '"limits' in line or "tick was slow" in line or "tick failed" in line)


def run_past_limits(sandbox: Sandbox, user: str, name: str, launcher: str = "",
                    extra_env: str = "") -> None:
    work = sandbox.user_dir(user, name)
    before = counted(sandbox, events.REQUEUE, "time_limit")
    hangs = counted(sandbox, events.REQUEUE, "hang")
    job_id = submit(sandbox, user, work, f"--steps {STEPS} --ckpt-every 100000 "
                                         "--step-seconds 0.5", sbatch_args=("--time=1",),
                    launcher=launcher, extra_env=extra_env)
    final = sandbox.wait_job(job_id, timeout=1500, poll=1.0)
    out = output(work, job_id)
    print(out)
    assert final.state == "COMPLETED", out + "\nthe agents said:\n" + limits_log(sandbox)
    stops = check_planned_restarts(sandbox, job_id, out)
    assert final.restarts == len(stops)
    n, _ = planned_count(final.admin_comment)
    assert n == len(stops), final.admin_comment
    assert parse_ledger(final.admin_comment) is None  # the hang count never moved
    assert counted(sandbox, events.REQUEUE, "time_limit") == before + len(stops)
    assert counted(sandbox, events.REQUEUE, "hang") == hangs
    # goodput: every run that stopped at its limit is a planned restart, never a failure
    # (no restart, lost or hung time), over the nodes the runs used
    nodes = sorted(set(re.findall(r"rank \d+ running step=\d+ at=[\d.]+ restarts=\d+ "
                                  r"node=(\w+)", out)))
    b = goodput(sandbox, job_id, nodes)
    print(json.dumps(b, indent=1))
    assert len(b["runs"]) == len(stops) + 1, b
    for r in b["runs"][:-1]:
        losses = r["losses"]
        assert losses["planned_restart"] > 0, r
        assert losses["restart"] == losses["lost_since_checkpoint"] == 0, r
        assert losses["hung_before_detection"] == 0, r


def test_a_job_past_its_time_limit_saves_is_requeued_and_resumes(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """Two ranks on two nodes (srun python), one minute a run, a save only when warned:
    each run saves the step it was at, the next resumes from it; the restarts are planned
    ones (their own AdminComment count and metrics cause, not the hang count), and the job
    finishes."""
    run_past_limits(sandbox, test_users[0], "limit")


def test_the_same_under_srun_torchrun(sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """srun starts one torchrun per node, each one worker: the agents warn the workers (not
    torchrun, which SIGUSR1 would end), and both save the same step."""
    port = random.randrange(20000, 32000)
    launcher = (f"sh -c 'exec {TORCHRUN} --nnodes=2 --nproc-per-node=1 "
                f"--node-rank=$SLURM_NODEID --master-addr=127.0.0.1 --master-port={port} "
                "\"$0\" \"$@\"'")
    run_past_limits(sandbox, test_users[0], "limit-torchrun", launcher=launcher,
                    extra_env="export PYTHONUNBUFFERED=1\n")


def preempt(sandbox: Sandbox, user: str, name: str, sbatch_args: tuple[str, ...] = ()
            ) -> tuple[Path, int]:
    """Start training (100 steps, no periodic save), and once it runs its first step take
    its nodes with a job of partition urgent; returns the work dir and the job id."""
    work = sandbox.user_dir(user, name)
    job_id = submit(sandbox, user, work, "--steps 100 --ckpt-every 100000 --step-seconds 0.5",
                    sbatch_args=sbatch_args)
    wait_for_output(sandbox, work, job_id, r"rank 0 running step=1 ", 300,
                    "the job's first step")
    nodes = sandbox.job(job_id).nodes
    # --exclusive: the training job's tasks leave cores free, which a job could share.
    urgent = sandbox.sbatch(["sleep", "1"], args=["-p", "urgent", f"-N{len(nodes)}",
                                                 "--exclusive", f"--nodelist={','.join(nodes)}"])
    assert sandbox.wait_job(urgent, timeout=300, poll=1.0).state == "COMPLETED"
    return work, job_id


def test_a_preempted_job_saves_within_its_grace_time_and_resumes(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A job of the higher-tier partition takes the nodes: the training job gets SIGTERM,
    saves the step it is at within the partition's GraceTime, Slurm requeues it, and it
    resumes from that step once the nodes are free; counted as planned, not as a hang."""
    hangs = counted(sandbox, events.REQUEUE, "hang")
    before = counted(sandbox, events.PLANNED, "preempt")
    work, job_id = preempt(sandbox, test_users[0], "preempt")
    final = sandbox.wait_job(job_id, timeout=600, poll=1.0)
    out = output(work, job_id)
    print(out)
    assert final.state == "COMPLETED", out
    m = re.search(r"stopped step=(\d+) cause=preempt at=[\d.]+: preempted: saved step "
                  r"([\d,]+)", out)
    assert m and int(m.group(1)) == int(m.group(2).replace(",", "")), out
    saved = int(m.group(1))
    assert re.search(rf"rank 0 running step={saved + 1} at=[\d.]+ restarts=1 ", out), out
    assert re.search(rf"done step=100 resumed_from={saved} restarts=1", out), out
    assert final.restarts == 1
    assert planned_count(final.admin_comment)[0] == 1, final.admin_comment
    assert parse_ledger(final.admin_comment) is None
    assert counted(sandbox, events.PLANNED, "preempt") == before + 1
    assert counted(sandbox, events.REQUEUE, "hang") == hangs


def test_a_job_preempted_under_cancel_saves_within_its_grace_time_and_ends(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """Partition spot preempts with PreemptMode=CANCEL (its own, the cluster's is REQUEUE):
    the training job saves the step it is at within the GraceTime, that step is committed
    and lands in S3 as the run's newest, and the job ends as Slurm ends a preempted job,
    not requeued (though --requeue); counted as a planned stop, never a hang or a
    failure."""
    user = test_users[0]
    hangs = counted(sandbox, events.REQUEUE, "hang")
    before = counted(sandbox, events.PLANNED, "preempt")
    requeues = counted(sandbox, events.REQUEUE, "preempt")
    work, job_id = preempt(sandbox, user, "preempt-cancel", ("-p", "spot"))
    final = sandbox.wait_job(job_id, timeout=600, poll=1.0)
    out = output(work, job_id)
    print(out)
    # A job that ends within its grace time: PREEMPTED from Slurm 24.05 on; up to 23.11
    # Slurm knows no grace-time preemption at the job's end, and its exit code decides.
    ends_as = "PREEMPTED" if sandbox.adapter().slurm_version() >= (24, 5) else "COMPLETED"
    assert final.state == ends_as, (final.state, out)
    assert final.restarts == 0
    m = re.search(r"stopped step=(\d+) cause=preempt at=[\d.]+: preempted: saved step "
                  r"([\d,]+), the job ends \(PreemptMode=CANCEL\)", out)
    assert m and int(m.group(1)) == int(m.group(2).replace(",", "")), out
    saved = int(m.group(1))
    assert "restarts=1" not in out and "done step=" not in out, out
    # The upload goes on after the job is gone: wait for the step's commit in S3.
    run = sandbox.layout.s3_dir / "ckpt" / user / work.name
    wait_for(lambda: (run / f"step-{saved:08d}" / "COMMIT.json").is_file(), 300,
             f"step {saved} committed in S3")
    in_s3 = sorted(int(p.parent.name.removeprefix("step-")) for p in run.glob("step-*/COMMIT.json"))
    assert in_s3[-1] == saved, in_s3
    assert planned_count(final.admin_comment)[0] == 1, final.admin_comment
    assert parse_ledger(final.admin_comment) is None
    assert counted(sandbox, events.PLANNED, "preempt") == before + 1
    assert counted(sandbox, events.REQUEUE, "preempt") == requeues
    assert counted(sandbox, events.REQUEUE, "hang") == hangs
    # goodput: the one run ends in a planned stop, no failure (no restart, lost or hung time)
    nodes = sorted(set(re.findall(r"rank \d+ running step=\d+ at=[\d.]+ restarts=\d+ "
                                  r"node=(\w+)", out)))
    b = goodput(sandbox, job_id, nodes)
    print(json.dumps(b, indent=1))
    assert len(b["runs"]) == 1, b
    losses = b["runs"][0]["losses"]
    assert losses["planned_restart"] > 0, b
    assert losses["restart"] == losses["lost_since_checkpoint"] == 0, b
    assert losses["hung_before_detection"] == 0, b
