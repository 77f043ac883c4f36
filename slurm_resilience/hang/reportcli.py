"""``slurm-resilience report JOBID``: a job's hang reports, fetched from the node agents.

Each agent keeps its node's reports in its own directory. Without ``--node`` this asks the
agents of every node the job ran on (from Slurm) over their metrics endpoint, with a munge
credential of the caller: the job's owner and root get the reports, anyone else is refused
in the same words as for a job without reports; this works from any login node. ``--node``
asks that node's agent over its unix socket instead (a host where the socket is reachable:
the node itself, or the sandbox).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from slurm_resilience import config
from slurm_resilience.agent import client
from slurm_resilience.config.paths import node_name, node_path


def register(sub: Any) -> None:
    p = sub.add_parser("report", help="a job's hang reports, from the node agents (the job's "
                                      "owner or root)")
    p.add_argument("job_id", type=int, help="the job whose reports to show")
    p.add_argument("--node", default="", help="ask only this node's agent, over its unix "
                                              "socket (default: the agents of every node the "
                                              "job ran on, over their metrics endpoints)")
    p.add_argument("--json", action="store_true", help="print the agents' answers as JSON")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for each agent's answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    if args.node:
        return _one(cfg, args)
    from slurm_resilience.queries.client import ask_all
    from slurm_resilience.queries.urls import agent_urls
    from slurm_resilience.slurm.adapter import from_config
    from slurm_resilience.slurm.jobfacts import slurm_facts
    from slurm_resilience.transport.credentials import for_queries

    facts = slurm_facts(from_config(cfg), args.job_id)
    nodes = facts.nodes()
    if not nodes:
        print(f"report: couldn't tell which nodes job {args.job_id} ran on "
              f"({facts.runs_error or 'no Slurm accounting'}"
              f"{'; ' + facts.info_error if facts.info_error else ''}); name one with --node",
              file=sys.stderr)
        return 2
    urls, unknown = agent_urls(cfg, nodes)
    got = [a for a in ask_all(urls, "report", args.job_id, for_queries(cfg.heartbeat.exchange),
                              args.timeout)]
    found = [a for a in got if a.body is not None]
    unreached = {**unknown, **{a.node: a.error for a in got if a.body is None
                               and not a.error.startswith("no hang report of job")}}
    for node, why in sorted(unreached.items()):
        print(f"report: couldn't ask {node}: {why}", file=sys.stderr)
    if not found:
        print(f"report: no hang report of job {args.job_id} for you on "
              f"{', '.join(nodes)}", file=sys.stderr)
        return 1 if not unreached else 2
    if args.json:
        json.dump([a.body for a in found], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for a in found:
        assert a.body is not None
        if len(found) > 1:
            print(f"== {a.node} ==")
        _print(a.body, a.node)
    return 0


def _one(cfg: config.Config, args: argparse.Namespace) -> int:
    node = node_name(args.node)
    path = node_path(cfg.agent.socket, node)
    try:
        answer = client.call(path, "hang.fetch", timeout=args.timeout, job_id=args.job_id)
    except client.AgentRefused as exc:
        print(f"report: fetch: couldn't get the reports of job {args.job_id}: {exc}",
              file=sys.stderr)
        return 1
    except client.AgentUnavailable as exc:
        print(f"report: fetch: couldn't reach the agent on {node}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(answer, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(answer, node)
    return 0


def _print(answer: Any, node: str) -> None:
    sys.stdout.write(str(answer.get("text", "")))
    if answer.get("truncated"):
        print(f"(truncated at heartbeat.max_report_bytes; the agent on {node} keeps the "
              "whole report)")
