"""``slurm-resilience goodput JOBID``: a job's allocated time on this node, split into
productive time and each kind of loss (see :mod:`slurm_resilience.goodput.compute`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from slurm_resilience import config
from slurm_resilience.config.paths import node_path
from slurm_resilience.goodput import compute
from slurm_resilience.goodput.ledger import (
    JobTimes,
    Ledger,
    chain_relaunches,
    from_json,
    merge,
    note_hangs,
)
from slurm_resilience.hang.incident import reports_of_job
from slurm_resilience.hang.status import incident_dir
from slurm_resilience.heartbeat.attempt import relaunch_of, restarts_of
from slurm_resilience.slurm.adapter import from_config
from slurm_resilience.slurm.jobfacts import SlurmFacts, slurm_facts
from slurm_resilience.slurm.parse import JobRun

# A run is still going in these; PENDING etc. after a requeue mean the last run is over.
RUNNING_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING",
                  "SIGNALING", "STAGE_OUT"}


def register(sub: Any) -> None:
    p = sub.add_parser("goodput", help="how much of a job's allocated time became training "
                                       "progress, and where the rest went")
    p.add_argument("job_id", type=int, metavar="JOBID", help="the Slurm job id")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--node", action="append", default=[],
                   help="read only this node's records, from this host's state (repeat it "
                        "for several); default: every node the job ran on, each from its "
                        "agent (over its metrics endpoint, so any login node can ask)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for each node's agent (default: 10)")
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


def only_their_runs(parts: Mapping[str, JobTimes | None], runs: list[JobRun]) -> list[str]:
    """Drop each node's record of a run whose allocation (sacct's NodeList) did not include
    the node: a node is charged only for runs it took part in. Runs sacct names no nodes for
    are kept as they are."""
    notes = []
    for node, part in parts.items():
        if part is None:
            continue
        for n in sorted(part.runs):
            acct = restarts_of(n)  # a relaunch runs inside its restart's allocation
            if acct < len(runs) and runs[acct].nodes and node not in runs[acct].nodes:
                del part.runs[n]
                notes.append(f"{node}'s record of {compute.run_label(n)} left out: the run's "
                             f"allocation ({','.join(runs[acct].nodes)}) did not include it")
    return notes


def job_breakdown(cfg: config.Config, parts: Mapping[str, JobTimes | None], job_id: int,
                  now: float, facts: SlurmFacts, unreached: Mapping[str, str] | None = None
                  ) -> compute.Breakdown:
    """The nodes' ledgers (with their hang reports) and Slurm's facts; then compute."""
    notes = only_their_runs(parts, facts.runs)
    missing = sorted(n for n, p in parts.items() if p is None and n not in (unreached or {}))
    job = merge(p for p in parts.values() if p is not None)
    if job is None or not job.runs:
        why = "; ".join(f"{n}: {e}" for n, e in sorted((unreached or {}).items()))
        raise FileNotFoundError(f"goodput: no record of job {job_id} on {', '.join(parts)} "
                                + (f"({why})" if why else
                                   f"(in {ledger_dir(cfg, next(iter(parts)))}; the agent "
                                   "keeps one for jobs it watched)"))
    if missing:
        notes.append(f"no record of the job on {', '.join(missing)}")
    notes.extend(f"couldn't ask {n}: {e}" for n, e in sorted((unreached or {}).items()))
    acct = facts.runs
    if acct:
        notes.append(allocation_times(job, acct))
    else:
        notes.append("allocation times from the agents' records (no Slurm accounting"
                     + (f": {facts.runs_error})" if facts.runs_error else ")"))
    over, completed = True, False
    if facts.info is not None:
        info = facts.info
        over, completed = info.state not in RUNNING_STATES, info.state == "COMPLETED"
        newest = max(job.runs, key=compute.in_order)
        if not over and restarts_of(newest) == info.restarts:
            job.runs[newest].end = now  # still running: up to now
    elif facts.gone:
        completed = bool(acct) and acct[-1].state == "COMPLETED"
        notes.append("slurmctld no longer knows the job: every run is over"
                     + (f" (accounting: {acct[-1].state})" if acct else ""))
    else:
        notes.append(f"couldn't ask Slurm about the job ({facts.info_error}); the last run "
                     "is taken as ended where the agent last saw it")
    chain_relaunches(job)
    b = compute.breakdown(job_id, [r.to_run() for r in job.runs.values()], over, completed)
    return compute.Breakdown(b.job_id, b.runs, tuple(notes) + b.notes)


def allocation_times(job: JobTimes, runs: list[JobRun]) -> str:
    """Each run's start and end from Slurm accounting, where it has them: the right source
    for what was allocated. Runs are matched in order (sacct --duplicates lists them oldest
    first, as the restart count numbers them). Relaunches inside one allocation share it:
    the first starts with it, the last ends with it (chain_relaunches joins the rest)."""
    used = 0
    for n, acct in enumerate(runs):
        within = sorted((k for k in job.runs if restarts_of(k) == n), key=compute.in_order)
        if not within:
            continue
        if acct.start is not None:
            job.runs[within[0]].start = acct.start
        if acct.end is not None:
            job.runs[within[-1]].end = acct.end
        used += 1
    return f"allocation times of {used} run(s) from Slurm accounting (sacct)"


def to_json(b: compute.Breakdown) -> dict[str, Any]:
    return {"job_id": b.job_id, "allocated_s": round(b.allocated_s, 3),
            "productive_s": round(b.productive_s, 3), "goodput_ratio": round(b.ratio, 4),
            "losses_s": {k: round(v, 3) for k, v in b.losses.items()},
            "unexplained_s": round(b.unexplained_s, 3),
            "explained_share": round(b.explained_share, 4),
            "runs": [{**asdict(r), "restarts": restarts_of(r.run), "relaunch": relaunch_of(r.run)}
                     for r in b.runs], "notes": list(b.notes)}


def gather(cfg: config.Config, nodes: list[str], job_id: int, timeout: float
           ) -> tuple[dict[str, JobTimes | None], dict[str, str]]:
    """Each node's part from its agent (a login node has none of the records); the agents
    that could not be asked, with why."""
    from slurm_resilience.queries.client import ask_all
    from slurm_resilience.queries.urls import agent_urls
    from slurm_resilience.transport.credentials import for_queries

    urls, unknown = agent_urls(cfg, nodes)
    parts: dict[str, JobTimes | None] = dict.fromkeys(nodes)
    unreached = dict(unknown)
    creds = for_queries(cfg.heartbeat.exchange)
    for a in ask_all(urls, "goodput", job_id, creds, timeout):
        if a.body is not None:
            parts[a.node] = from_json(a.body.get("ledger"))
        elif a.error.startswith(f"no record of job {job_id} on "):
            continue  # the node has none: a missing part, said as such
        else:
            unreached[a.node] = a.error
    return parts, unreached


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    facts = slurm_facts(from_config(cfg), args.job_id)
    unreached: dict[str, str] = {}
    try:
        if args.node:
            parts = {n: node_part(cfg, n, args.job_id) for n in args.node}
        else:
            nodes = facts.nodes()
            if not nodes:
                print(f"goodput: couldn't tell which nodes job {args.job_id} ran on "
                      f"({facts.runs_error or 'no Slurm accounting'}"
                      f"{'; ' + facts.info_error if facts.info_error else ''}); name them "
                      "with --node on a host that has their records", file=sys.stderr)
                return 1
            parts, unreached = gather(cfg, nodes, args.job_id, args.timeout)
        b = job_breakdown(cfg, parts, args.job_id, time.time(), facts, unreached)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"goodput: {exc.filename}: permission denied (root only)", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"goodput: an agent's answer is not a goodput record: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(to_json(b), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(compute.render(b))
    return 0
