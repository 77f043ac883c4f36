"""Recovery from a hang: relaunch on a hot spare inside the allocation, against the plain
requeue path, in the same sandbox and the same run.

A 2-node gloo job (examples/train.py, checkpoint every 5 steps) wedges rank 1 at step 12.
The spare path runs it under ``slurm-resilience launch --spares 1`` on a 3-node
allocation; the requeue path is the same job under plain ``srun`` on 2 nodes. Rounds
alternate the two so machine noise hits both. Reported per path: fault (the hang line's
time) to the first step after the restore (the first ``running`` line of the next run,
printed after ``load_latest()``), and for the spare path its parts: detection (hang to
the agent's incident), decision and evidence (to the relaunch order), teardown (order
to the old step gone, the launcher's stamps), srun to the ranks' processes, their Python
and torch start-up with the process group, and the restore (to running again).

``--fault node-loss`` loses a node instead: once a step is in S3 the S3 endpoint is
stopped, the next step is committed on the nodes (and copied to each node's buddy), and
every process of the step node that is not the batch host is SIGKILLed, as a power cut
would. The spare path (``launch --spares 1``, ``--no-kill``) resumes on the survivor and
the spare from that step, the lost node's part from its buddy, with S3 still down; the
requeue path (``launch --spares 0``, S3 up) is requeued away from the lost node. Reported:
fault (the kill) to the first step after the restore, and for the spare path its parts:
detection (the kill to the step's end, as the survivor's collective fails), the node
found lost (to the relaunch order: its slurmd and agent unreachable for
``heartbeat.node_unreachable_s``, or Slurm marking it), teardown, srun, start-up and
restore.

Goal (issue 23): the spare path at most half the requeue path's time. Run as root (the
sandbox needs it) with a test user that exists (the sandbox tests create srtest1)::

    .venv/bin/python benchmarks/bench_recovery.py [--rounds 2] [--user srtest1]
    .venv/bin/python benchmarks/bench_recovery.py --fault node-loss --rounds 1
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import free_port_base  # noqa: E402
from hang_jobs import (  # noqa: E402
    acting,
    committed_in_s3,
    output,
    reports,
    s3_stopped,
    step_nodes,
    submit,
    submit_launch,
    wait_for,
)

from slurm_resilience.sandbox.handle import Sandbox  # noqa: E402
from slurm_resilience.sandbox.layout import Layout  # noqa: E402
from slurm_resilience.sandbox.nodekill import kill_node, revive_node  # noqa: E402

ARGS = "--steps 24 --ckpt-every 5 --hang-at-step 12 --hang-rank 1"
# Node loss: a checkpoint every 20 steps of 0.3 s leaves 6 s between commits to kill the
# node after one (and its buddy copy), and steps to run after the resume.
LOSS_ARGS = "--steps 100 --ckpt-every 20 --step-seconds 0.3"


def _stamp(pattern: str, out: str) -> float:
    m = re.search(pattern, out)
    if not m:
        raise RuntimeError(f"no line matching {pattern!r} in the job's output:\n{out}")
    return float(m.group(1))


def one(box: Sandbox, user: str, spare: bool, n: int) -> dict[str, float]:
    work = box.user_dir(user, f"{'spare' if spare else 'requeue'}-{n}")
    job_id = (submit_launch(box, user, work, ARGS) if spare
              else submit(box, user, work, ARGS))
    wait_for(lambda: acting(reports(box, job_id), 0), 300, "the decision")
    final = box.wait_job(job_id, timeout=400)
    report = acting(reports(box, job_id), 0)  # the final copy, with the action's time
    assert report is not None
    out = output(work, job_id)
    if final.state != "COMPLETED":
        raise RuntimeError(f"job {job_id} ended {final.state}:\n{out}")
    hang = _stamp(r"rank 1 hanging at step=12 at=([\d.]+)", out)
    again = min(float(m) for m in re.findall(r"rank \d running step=\d+ at=([\d.]+) restarts=1",
                                             out))
    parts = {"total": again - hang,
             "detect": float(report["detected_at"]) - hang,  # type: ignore[arg-type]
             "decide": float(report["timings"]["action_at"]) - float(  # type: ignore[index]
                 report["detected_at"])}  # type: ignore[arg-type]
    if spare:
        ended = _stamp(r"step of relaunch 0 ended at=([\d.]+)", out)
        parts["teardown"] = ended - float(report["timings"]["action_at"])  # type: ignore[index]
        # The relaunched ranks' own stamps (examples/train.py): process start (before torch
        # is imported) and the process group up; the earliest rank of the relaunch.
        up = [(float(a), float(b)) for a, b in re.findall(
            r"started at=([\d.]+) distributed_at=([\d.]+)", out) if float(a) > ended]
        started, distributed = min(a for a, _ in up), min(b for _, b in up)
        parts["srun to process"] = started - ended
        parts["import+pg init"] = distributed - started
        parts["restore"] = again - distributed
    return parts


def _local_commit(box: Sandbox, node: str, job_id: int, step: int) -> Path:
    return box.layout.nodes_dir / node / "nvme" / f"job-{job_id}" / f"step-{step:08d}" / \
        "COMMIT.json"


def node_loss(box: Sandbox, user: str, spare: bool, n: int) -> dict[str, float]:
    """One node lost after a commit: the spare path with S3 down (the buddy's copy), or the
    requeue path with S3 up. The lost node is brought back (and resumed) afterwards."""
    work = box.user_dir(user, f"{'spare' if spare else 'requeue'}-loss-{n}")
    job_id = submit_launch(box, user, work, LOSS_ARGS, nodes=3 if spare else 2,
                           spares=1 if spare else 0, sbatch_args=("--no-kill",))
    _host, lost = step_nodes(box, work, job_id, timeout=300)
    wait_for(lambda: 20 in committed_in_s3(box, user, work), 300, "step 20 committed in S3")
    with s3_stopped(box, stop=spare):  # the spare path: S3 down, the buddy's copy
        wait_for(lambda: _local_commit(box, lost, job_id, 40).exists(), 300,
                 f"step 40 committed on {lost}")
        if not spare:
            # A requeue leaves the allocation, and the survivor's buddy copy with it: the
            # reference path resumes from S3, so the step must be whole there first.
            wait_for(lambda: 40 in committed_in_s3(box, user, work), 300, "step 40 in S3")
        if spare:  # its copy on the buddy (spares included in the ring) before the loss
            buddy = box.layout.nodes_dir / "*" / "nvme" / ".buddy" / f"job-{job_id}" / \
                f"from-{lost}" / "step-00000040" / "COMMIT.json"
            wait_for(lambda: list(Path("/").glob(str(buddy).lstrip("/"))), 120,
                     f"the buddy copy of {lost}'s step 40")
        killed_at = time.time()
        assert kill_node(box.layout, lost), f"nothing of {lost} was running"
        again = wait_for(lambda: re.search(r"rank \d running step=\d+ at=([\d.]+) restarts=1",
                                           output(work, job_id)), 600,
                         "the first step after the restore")
    final = box.wait_job(job_id, timeout=600)
    out = output(work, job_id)
    revive_node(box.layout, lost)
    if final.state != "COMPLETED":
        raise RuntimeError(f"job {job_id} ended {final.state}:\n{out}")
    resumed = re.search(r"done step=100 resumed_from=(\d+) ", out)
    if not resumed or int(resumed.group(1)) < 40:
        raise RuntimeError(f"job {job_id} did not resume from step 40 or later:\n{out}")
    parts = {"total": float(again.group(1)) - killed_at}
    if spare:
        found = re.search(r"step ended with status \d+ at=([\d.]+); asking", out)
        step_end = float(found.group(1)) if found else None
        ordered = _stamp(r"order for relaunch 1 at=([\d.]+)", out)
        ended = _stamp(r"step of relaunch 0 ended at=([\d.]+)", out)
        if step_end is not None:
            parts["step fails"] = step_end - killed_at
            parts["node found lost"] = ordered - step_end
        else:
            parts["to order"] = ordered - killed_at
        parts["teardown"] = max(0.0, ended - ordered)
        up = [(float(a), float(b)) for a, b in re.findall(
            r"started at=([\d.]+) distributed_at=([\d.]+)", out) if float(a) > ordered]
        started, distributed = min(a for a, _ in up), min(b for _, b in up)
        parts["srun to process"] = started - max(ended, ordered)
        parts["import+pg init"] = distributed - started
        parts["restore"] = float(again.group(1)) - distributed
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="jobs per path (default: 2)")
    parser.add_argument("--user", default="srtest1", help="the unprivileged user running the "
                                                          "jobs (default: srtest1)")
    parser.add_argument("--fault", choices=("hang", "node-loss"), default="hang",
                        help="what strikes: rank 1 hangs (default), or a step node is lost "
                             "(S3 down on the spare path: the restore goes through the buddy "
                             "copy)")
    parser.add_argument("--port-base", type=int, default=0,
                        help="first port of the benchmark's own sandbox (default: a free one)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the sandbox's state directory (its logs and the jobs' "
                             "output) and print where it is")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="sr-bench-recovery-", dir="/tmp"))
    state.chmod(0o755)
    box = Sandbox.start(Layout(state_dir=state, nodes=4, leaves=2,
                               port_base=args.port_base or free_port_base(4), repo=REPO))
    loss = args.fault == "node-loss"
    if loss:
        box.update_resilience_config({"checkpoint": {"buddy_copies": True}})
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for n in range(args.rounds):
            for spare in (True, False):
                results[spare].append(node_loss(box, args.user, spare, n) if loss
                                      else one(box, args.user, spare, n))
                box.reset(timeout=120)
                if loss:
                    box.update_resilience_config({"checkpoint": {"buddy_copies": True}})
    finally:
        box.stop()
        if args.keep:
            print(f"sandbox kept: {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)
    med = {spare: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for spare, rs in results.items()}
    print(f"{args.fault}: fault -> first step after restore, median of {args.rounds} "
          "(seconds):")
    ref = "" if loss else (f"; detect {med[False]['detect']:.1f}, decide "
                           f"{med[False]['decide']:.1f}")
    print(f"  requeue path        {med[False]['total']:6.1f}  (reference{ref})")
    s = med[True]
    print(f"  spare path          {s['total']:6.1f}  {s['total'] / med[False]['total']:.2f}x "
          f"reference")
    for part, seconds in s.items():
        if part != "total":
            print(f"    {part:18s}{seconds:6.1f}")
    ok = s["total"] <= 0.5 * med[False]["total"]
    print(f"goal: spare path <= 0.5x the requeue path: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
