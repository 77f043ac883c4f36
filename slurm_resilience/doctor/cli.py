"""``slurm-resilience doctor``: every problem in this node's setup, with its fix."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from slurm_resilience.config import lastgood
from slurm_resilience.config.paths import node_name


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check this node's setup (slurm.conf, plugstack, munge, "
                                      "agent, hook server, configuration, S3); exits 1 "
                                      "naming each problem and its fix")
    p.add_argument("--node", default="", help="Slurm node name (default: node.name from "
                   "config, then SLURMD_NODENAME, then the hostname)")
    p.add_argument("--json", action="store_true", help="print the problems as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from slurm_resilience.doctor import checks, facts
    from slurm_resilience.slurm.adapter import from_config

    loaded = lastgood.load(args.config)
    node = node_name(args.node or loaded.cfg.node.name)
    problems = checks.run(facts.gather(loaded, node, from_config(loaded.cfg)))
    if args.json:
        json.dump({"node": node, "problems": [asdict(p) for p in problems]}, sys.stdout,
                  indent=1)
        sys.stdout.write("\n")
    elif problems:
        print(f"doctor: {node}: {len(problems)} problem(s)")
        for p in problems:
            print(f"  {p.check}: {p.what}\n    fix: {p.fix}")
    else:
        print(f"doctor: {node}: no problems found ({len(checks.CHECKS)} checks)")
    return 1 if problems else 0
