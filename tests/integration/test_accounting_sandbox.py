"""Slurm accounting, the real thing: a sandbox with slurmdbd over MariaDB. The requeue of a
hung job shows in `sacct`, a job we held at the hang cap shows held, and our drain reasons
show in `sacctmgr show event`, the way a site sees them.

Goodput of the hung-once job, against what the test knows: the allocation of each run from
sacct (whole seconds), and the job's own printed clock (examples/train.py's ``at=`` stamps:
each run's "running" line just before its first step, each checkpoint after its section, the
hang, done). Tolerances, from those resolutions plus one agent tick (0.5 s):

* stage-in + time before the first step of each run: from the run's sacct Start to its
  "running" line, +1.5 s (the first step itself, then sacct's truncation) / -1.0 s;
* lost since checkpoint: from the checkpoint of step 10 to the hang, 1.0 s;
* hung before detection: from the hang to the report's detection time, 1.5 s;
* restart: from the detection to run 0's sacct End, 1.5 s;
* after the last step: from the checkpoint of step 30 to run 1's sacct End, 1.5 s;
* checkpoint stalls: the printed stall_ms of the saves each run kept, 0.5 s in all;
* productive: 28 kept steps (2..10, then 12..30) of 0.1 s sleep plus compute: between 2.8 s
  and 14 s (0.5 s a step);
* all of them together explain the allocated time but for the gap between the steps' time
  on the job's clock and goodput's estimate of it (the kept steps times their mean step
  time), within 4 s (each run's first step, and sacct's whole seconds at each end of both
  runs).

Holds: ``scontrol requeuehold`` (the hang cap) requeues the run and holds the job. On
Slurm 22.05 sacct shows that as the run REQUEUED and the job's newest record PENDING with
Reason JobHeldAdmin (sacct's Reason is "the last reason a job was blocked from running");
our reason lives in the AdminComment, which scontrol shows.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, cast

import pytest
from conftest import SandboxFactory
from hang_jobs import (
    TRAIN,
    acting,
    clock_minus_productive_s,
    job_clock,
    output,
    reports,
    submit,
    wait_for,
    wait_for_decision,
)

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.slurm.parse import parse_sacct_runs

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def test_sacct_shows_the_hang_requeue_and_sacctmgr_our_drains(
        sandbox_factory: SandboxFactory, test_users: tuple[str, ...]) -> None:
    box: Sandbox = sandbox_factory(nodes=3, leaves=1, with_accounting=True)
    user = test_users[0]
    work = box.user_dir(user, "acct")
    # The user names the script: an OSC title, a screen clear and a forged line in its path
    # reach the report's stacks, which must show them escaped.
    hostile = work / "tr\x1b]0;owned\x07ain\x1b[2J\nSR: fake line.py"
    hostile.write_bytes(TRAIN.read_bytes())
    os.chown(hostile, work.stat().st_uid, work.stat().st_gid)
    job_id = submit(box, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                     "--hang-rank 1", nodes=1, tasks=2, train=hostile)
    wait_for_decision(box, work, job_id)
    final = box.wait_job(job_id, timeout=180)
    assert final.state == "COMPLETED"

    def states() -> list[str]:
        out = box.run(["sacct", "-j", str(job_id), "--duplicates", "-X", "-n", "-P",
                       "-o", "JobID,State"]).stdout
        return [line.split("|")[1] for line in out.splitlines() if line.strip()]

    got = wait_for(lambda: (s := states()) and "REQUEUED" in s and "COMPLETED" in s and s,
                   60, "the requeue in sacct")
    print(f"sacct: job {job_id}: {got}")
    # Goodput takes the allocation times from accounting, the right source for them. Asked
    # as the job's user from this host, which runs no agent of its own (a login node): the
    # command finds the job's nodes in Slurm and asks their agents, charging each node only
    # for the runs it was allocated to.
    cli = [sys.executable, "-m", "slurm_resilience", "--config", str(box.layout.resilience_conf)]
    out = box.run([*cli, "goodput", str(job_id), "--json"], user=user)
    b = json.loads(out.stdout)
    print(json.dumps(b, indent=1))
    assert "allocation times of 2 run(s) from Slurm accounting (sacct)" in b["notes"]
    assert not [n for n in b["notes"] if "couldn't ask" in n or "no record" in n], b["notes"]
    assert len(b["runs"]) == 2
    # Its hang report, the same way: the owner gets it, another user the same refusal as
    # for a job without one.
    mine = box.run([*cli, "report", str(job_id)], user=user)
    assert f"job {job_id}" in mine.stdout and "requeue" in mine.stdout, mine.stdout
    assert "\\x1b]0;owned\\x07ain" in mine.stdout, mine.stdout  # the stack names the script
    assert "\x1b" not in mine.stdout and "\x07" not in mine.stdout
    assert not any(line.startswith("SR: fake") for line in mine.stdout.splitlines())
    theirs = box.run([*cli, "report", str(job_id)], user=test_users[1], check=False)
    assert theirs.returncode == 1 and theirs.stdout == "", theirs
    assert f"no hang report of job {job_id} for you" in theirs.stderr, theirs.stderr
    check_goodput(box, job_id, b, output(work, job_id))
    check_hold_in_sacct(box, user)

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


def check_goodput(box: Sandbox, job_id: int, b: dict[str, Any], out: str) -> None:
    """Each category against the job's clock and sacct (tolerances in the docstring)."""
    acct = parse_sacct_runs(box.run(["sacct", "-j", str(job_id), "--duplicates", "-X", "-n",
                                     "-P", "-o", "JobID,State,Start,End"]).stdout)
    clock = job_clock(out)
    print(f"sacct runs: {acct}\njob clock: {clock}")
    assert len(acct) == 2 and all(r.start and r.end for r in acct), acct
    (hang_step, hung_at), = clock["hangs"]
    assert hang_step == 12
    report = acting(reports(box, job_id), 0)
    assert report is not None
    detected = float(report["detected_at"])  # type: ignore[arg-type]
    runs = b["runs"]
    for n, r in enumerate(runs):
        start = acct[n].start
        assert start is not None
        startup = r["losses"]["stagein"] + r["losses"]["before_first_step"]
        known = clock["running"][n] - start
        assert -1.0 <= startup - known <= 1.5, (n, startup, known)
    ckpt10, _ = clock["checkpoints"][10]
    ckpt30, _ = clock["checkpoints"][30]
    end0, end1 = acct[0].end, acct[1].end
    assert end0 is not None and end1 is not None
    losses = b["losses_s"]
    want = {"lost_since_checkpoint": (hung_at - ckpt10, 1.0),
            "hung_before_detection": (detected - hung_at, 1.5),
            "restart": (end0 - detected, 1.5),
            "after_last_step": (end1 - ckpt30, 1.5),
            "checkpoint_stall": (sum(s for _, s in clock["checkpoints"].values()), 0.5)}
    for kind, (known_s, tol) in want.items():
        assert abs(losses[kind] - known_s) <= tol, (kind, losses[kind], known_s, tol)
    # Kept progress: run 0 up to the step-10 save, run 1 from its first step to the step-30
    # save, less the saves' stalls (steps slow down on a loaded machine: no per-step bound).
    kept = (ckpt10 - clock["running"][0]) + (ckpt30 - clock["running"][1]) \
        - sum(s for _, s in clock["checkpoints"].values())
    # Goodput counts each run's first step as start-up (before_first_step), so it keeps one
    # step fewer per run than this clock, and it multiplies the steps by their mean time
    # (measured from the beats an agent tick saw): two step times and 15% besides.
    step = (ckpt30 - clock["running"][1]) / 20
    assert abs(b["productive_s"] - kept) <= 2.0 + 2 * step + 0.15 * kept, (
        b["productive_s"], kept, step, b)
    # Productive time is the steps times their mean: the gap between the steps' time on the
    # job's own clock and that estimate is what goes unexplained (the beats' stamps against
    # the job's printed ones). Everything else is explained, to the runs' first steps and
    # sacct's whole seconds (a second at each end of each run).
    gap = clock_minus_productive_s(clock, b["productive_s"])
    assert abs(b["unexplained_s"] - gap) <= 4.0, (b["unexplained_s"], gap, b)


# The hold reasons sacct may record for ``scontrol requeuehold`` (22.05 records the user's).
HELD = ("JobHeldUser", "JobHeldAdmin")


def check_hold_in_sacct(box: Sandbox, user: str) -> None:
    """A job that hangs on every run is requeued, then held (the hang cap of 1, or its
    checkpoint not advancing); sacct shows the requeued runs and the held job.

    Seen on 22.05: the runs before are REQUEUED rows (our AdminComment on them), and the
    held job is a PENDING row with Reason JobHeldUser (``scontrol requeuehold``'s hold) and
    priority 0, with an empty AdminComment: the hold's text is read from scontrol."""
    box.update_resilience_config({"heartbeat": {"max_requeues": 1}})
    work = box.user_dir(user, "acct-hold")
    job_id = submit(box, user, work, "--steps 30 --ckpt-every 5 --hang-at-step 12 "
                                     "--hang-rank 1 --fault-every-run", nodes=1, tasks=2)
    try:
        def hold() -> dict[str, Any] | None:
            return next((r["decision"] for r in reports(box, job_id)
                         if isinstance(r["decision"], dict)
                         and r["decision"].get("action") == "hold"), None)

        print(f"held: {wait_for(hold, 240, 'the hold decision')}")

        def rows() -> list[list[str]]:
            text = box.run(["sacct", "-j", str(job_id), "--duplicates", "-X", "-n", "-P",
                            "-o", "JobID,State,Reason,Priority,AdminComment"]).stdout
            return [line.split("|") for line in text.splitlines() if line.strip()]

        def held_row() -> list[list[str]] | None:
            r = rows()
            return r if r and r[-1][1] == "PENDING" and r[-1][2] in HELD else None

        got = cast(list[list[str]], wait_for(held_row, 60, "the held job in sacct"))
        print(f"sacct: job {job_id}: {got}")
        states = [row[1] for row in got]
        assert states.count("REQUEUED") >= 2, states  # run 0 requeued, run 1 requeue-held
        assert got[-1][3] == "0", got  # held: priority 0
        assert "held" in box.job(job_id).admin_comment
    finally:
        box.run(["scancel", str(job_id)])
