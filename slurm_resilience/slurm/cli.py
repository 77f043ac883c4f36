"""``slurm-resilience slurm …``: the adapter's operations for operators and scripts."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from slurm_resilience import config
from slurm_resilience.slurm.adapter import from_config
from slurm_resilience.slurm.errors import ForeignDrain, SlurmError


def register(sub: Any) -> None:
    p = sub.add_parser("slurm", help="drain/resume nodes and requeue jobs through the adapter")
    ssub = p.add_subparsers(dest="slurm_command", metavar="ACTION", required=True)
    d = ssub.add_parser("drain", help="drain a node with our prefixed reason")
    d.add_argument("node", help="the Slurm node name to drain")
    d.add_argument("reason", nargs="+", help="why, as operators will read it in sinfo -R "
                   "(the SR: prefix is added)")
    d.set_defaults(func=_drain)
    r = ssub.add_parser("resume", help="resume a node, only if we drained it")
    r.add_argument("node", help="the Slurm node name to return to service (only a "
                   "drain this suite set is lifted)")
    r.set_defaults(func=_resume)
    q = ssub.add_parser("requeue", help="requeue a job (--hold to hold it)")
    q.add_argument("job_id", help="the Slurm job id to requeue")
    q.add_argument("--hold", metavar="REASON", help="requeue held with this admin comment")
    q.set_defaults(func=_requeue)
    n = ssub.add_parser("show-node", help="print a node as the adapter parses it (JSON)")
    n.add_argument("node", help="the Slurm node name")
    n.set_defaults(func=_show_node)
    j = ssub.add_parser("show-job", help="print a job as the adapter parses it (JSON)")
    j.add_argument("job_id", help="the Slurm job id")
    j.set_defaults(func=_show_job)


def _adapter(args: argparse.Namespace) -> Any:
    return from_config(config.load(args.config))


def _fail(exc: SlurmError) -> int:
    print(f"slurm-resilience: {exc}", file=sys.stderr)
    return 1


def _drain(args: argparse.Namespace) -> int:
    try:
        reason = _adapter(args).drain(args.node, " ".join(args.reason))
    except SlurmError as exc:
        return _fail(exc)
    print(f"{args.node}: drained: {reason}")
    return 0


def _resume(args: argparse.Namespace) -> int:
    try:
        done = _adapter(args).resume(args.node)
    except ForeignDrain as exc:
        print(f"slurm-resilience: refused: {exc.slurm_message}", file=sys.stderr)
        return 3
    except SlurmError as exc:
        return _fail(exc)
    print(f"{args.node}: {'resumed' if done else 'not drained; nothing to do'}")
    return 0


def _requeue(args: argparse.Namespace) -> int:
    adapter = _adapter(args)
    try:
        if args.hold:
            adapter.requeue_hold(args.job_id, args.hold)
        else:
            adapter.requeue(args.job_id)
    except SlurmError as exc:
        return _fail(exc)
    print(f"job {args.job_id}: requeued{' held' if args.hold else ''}")
    return 0


def _dump(obj: Any) -> None:
    data = asdict(obj)
    data["raw"] = dict(obj.raw)
    print(json.dumps(data, indent=2, default=sorted))


def _show_node(args: argparse.Namespace) -> int:
    try:
        _dump(_adapter(args).show_node(args.node))
    except SlurmError as exc:
        return _fail(exc)
    return 0


def _show_job(args: argparse.Namespace) -> int:
    try:
        _dump(_adapter(args).show_job(args.job_id))
    except SlurmError as exc:
        return _fail(exc)
    return 0
