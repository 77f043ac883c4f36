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

Goal (issue 23): the spare path at most half the requeue path's time. Run as root (the
sandbox needs it) with a test user that exists (the sandbox tests create srtest1)::

    .venv/bin/python benchmarks/bench_recovery.py [--rounds 2] [--user srtest1]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import free_port_base  # noqa: E402
from hang_jobs import acting, output, reports, submit, submit_launch, wait_for  # noqa: E402

from slurm_resilience.sandbox.handle import Sandbox  # noqa: E402
from slurm_resilience.sandbox.layout import Layout  # noqa: E402

ARGS = "--steps 24 --ckpt-every 5 --hang-at-step 12 --hang-rank 1"


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="jobs per path (default: 2)")
    parser.add_argument("--user", default="srtest1", help="the unprivileged user running the "
                                                          "jobs (default: srtest1)")
    parser.add_argument("--port-base", type=int, default=0,
                        help="first port of the benchmark's own sandbox (default: a free one)")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="sr-bench-recovery-", dir="/tmp"))
    state.chmod(0o755)
    box = Sandbox.start(Layout(state_dir=state, nodes=4, leaves=2,
                               port_base=args.port_base or free_port_base(4), repo=REPO))
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for n in range(args.rounds):
            for spare in (True, False):
                results[spare].append(one(box, args.user, spare, n))
                box.reset()
    finally:
        box.stop()
        shutil.rmtree(state, ignore_errors=True)
    med = {spare: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for spare, rs in results.items()}
    print(f"fault -> first step after restore, median of {args.rounds} (seconds):")
    print(f"  requeue path        {med[False]['total']:6.1f}  (reference; detect "
          f"{med[False]['detect']:.1f}, decide {med[False]['decide']:.1f})")
    s = med[True]
    print(f"  spare path          {s['total']:6.1f}  {s['total'] / med[False]['total']:.2f}x "
          f"reference")
    for part in ("detect", "decide", "teardown", "srun to process", "import+pg init",
                 "restore"):
        print(f"    {part:18s}{s[part]:6.1f}")
    ok = s["total"] <= 0.5 * med[False]["total"]
    print(f"goal: spare path <= 0.5x the requeue path: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
