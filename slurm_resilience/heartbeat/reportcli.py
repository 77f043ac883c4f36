"""``slurm-resilience report JOBID``: a job's hang reports, fetched from the node agent.

The agent keeps every report in its own directory; this asks it over its socket, which
checks the caller's kernel credentials: the job's owner and root get the reports, anyone
else is refused. Run it on a node of the hung run (the batch host has the full report;
``srun -w NODE`` or the requeued job's own script can call it), or name one with ``--node``
when the agents' sockets are reachable from here (the sandbox).
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
    p = sub.add_parser("report", help="a job's hang reports, from the node agent (the job's "
                                      "owner or root)")
    p.add_argument("job_id", type=int, help="the job whose reports to show")
    p.add_argument("--node", default="", help="the node whose agent to ask (default: this "
                                              "node); the hung run's batch host has the "
                                              "full report")
    p.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the agent's answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    node = node_name(args.node or cfg.node.name)
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
        sys.stdout.write(str(answer.get("text", "")))
        if answer.get("truncated"):
            print(f"(truncated at heartbeat.max_report_bytes; the agent on {node} keeps the "
                  "whole report)")
    return 0
