"""``slurm-resilience goodput JOBID``: a job's allocated time on this node, split into
productive time and each kind of loss (see :mod:`slurm_resilience.goodput.compute`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from slurm_resilience import config
from slurm_resilience.config.paths import node_name, node_path
from slurm_resilience.goodput import compute
from slurm_resilience.goodput.ledger import JobTimes, Ledger, merge, note_hangs
from slurm_resilience.heartbeat.incident import reports_of_job
from slurm_resilience.heartbeat.status import incident_dir
from slurm_resilience.slurm.adapter import from_config
from slurm_resilience.slurm.errors import JobNotFound, SlurmError
from slurm_resilience.slurm.parse import JobRun

# A run is still going in these; PENDING etc. after a requeue mean the last run is over.
RUNNING_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING",
                  "SIGNALING", "STAGE_OUT"}


def register(sub: Any) -> None:
    p = sub.add_parser("goodput", help="how much of a job's allocated time on this node became "
                                       "training progress, and where the rest went")
    p.add_argument("job_id", type=int, metavar="JOBID", help="the Slurm job id")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--node", action="append", default=[],
                   help="node whose records to read (default: this node); repeat it to "
                        "combine the nodes of the job whose records this host can read "
                        "(each agent keeps its own node's part)")
    p.set_defaults(func=run)


def ledger_dir(cfg: config.Config, node: str) -> str:
    return os.path.join(node_path(cfg.node.state_dir, node), "goodput")


def node_part(cfg: config.Config, node: str, job_id: int) -> JobTimes | None:
    """One node's ledger of the job, with that node's hang reports."""
    job = Ledger(ledger_dir(cfg, node)).load(job_id)
    if job is None:
        return None
    directory = incident_dir(node_path(cfg.node.state_dir, node),
                             node_path(cfg.heartbeat.incident_dir, node))
    note_hangs(job, reports_of_job(directory, job_id))
    return job


def job_breakdown(cfg: config.Config, nodes: list[str], job_id: int, now: float
                  ) -> compute.Breakdown:
    """Read the nodes' ledgers and hang reports and Slurm's job state; then compute."""
    notes: list[str] = []
    parts = {n: node_part(cfg, n, job_id) for n in nodes}
    missing = sorted(n for n, p in parts.items() if p is None)
    job = merge(p for p in parts.values() if p is not None)
    if job is None or not job.runs:
        raise FileNotFoundError(f"goodput: no record of job {job_id} on {', '.join(nodes)} "
                                f"(in {ledger_dir(cfg, nodes[0])}; the agent keeps one for "
                                "jobs it watched)")
    if missing:
        notes.append(f"no record of the job on {', '.join(missing)}")
    adapter = from_config(cfg)
    acct: list[JobRun] = []
    try:
        acct = adapter.job_runs(job_id)
        notes.append(allocation_times(job, acct))
    except SlurmError as exc:
        notes.append(f"allocation times from the agents' records (no Slurm accounting: "
                     f"{exc})")
    over, completed = True, False
    try:
        info = adapter.show_job(job_id)
        over, completed = info.state not in RUNNING_STATES, info.state == "COMPLETED"
        if not over and max(job.runs) == info.restarts:
            job.runs[max(job.runs)].end = now  # still running: up to now
    except JobNotFound:
        completed = bool(acct) and acct[-1].state == "COMPLETED"
        notes.append("slurmctld no longer knows the job: every run is over"
                     + (f" (accounting: {acct[-1].state})" if acct else ""))
    except SlurmError as exc:
        notes.append(f"couldn't ask Slurm about the job ({exc}); the last run is taken as "
                     "ended where the agent last saw it")
    b = compute.breakdown(job_id, [r.to_run() for r in job.runs.values()], over, completed)
    return compute.Breakdown(b.job_id, b.runs, tuple(notes) + b.notes)


def allocation_times(job: JobTimes, runs: list[JobRun]) -> str:
    """Each run's start and end from Slurm accounting, where it has them: the right source
    for what was allocated. Runs are matched in order (sacct --duplicates lists them oldest
    first, as the restart count numbers them)."""
    used = 0
    for n, acct in enumerate(runs):
        r = job.runs.get(n)
        if r is None:
            continue
        if acct.start is not None:
            r.start = acct.start
        if acct.end is not None:
            r.end = acct.end
        used += 1
    return f"allocation times of {used} run(s) from Slurm accounting (sacct)"


def to_json(b: compute.Breakdown) -> dict[str, Any]:
    return {"job_id": b.job_id, "allocated_s": round(b.allocated_s, 3),
            "productive_s": round(b.productive_s, 3), "goodput_ratio": round(b.ratio, 4),
            "losses_s": {k: round(v, 3) for k, v in b.losses.items()},
            "unexplained_s": round(b.unexplained_s, 3),
            "explained_share": round(b.explained_share, 4),
            "runs": [asdict(r) for r in b.runs], "notes": list(b.notes)}


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    nodes = args.node or [node_name(cfg.node.name)]
    try:
        b = job_breakdown(cfg, nodes, args.job_id, time.time())
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"goodput: {exc.filename}: permission denied (root only)", file=sys.stderr)
        return 1
    if args.json:
        json.dump(to_json(b), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(compute.render(b))
    return 0
