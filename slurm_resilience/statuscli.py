"""``slurm-resilience status [--json]``: drains we own, hang incidents, requeued and held jobs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from slurm_resilience import config
from slurm_resilience.config import lastgood
from slurm_resilience.config.paths import node_name, node_path
from slurm_resilience.hang import status as st
from slurm_resilience.slurm.adapter import from_config
from slurm_resilience.slurm.errors import SlurmError


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="what slurm-resilience did: drains, hang incidents, "
                                      "requeued and held jobs")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--node", default="", help="node whose incident reports to list "
                   "(default: this node)")
    p.add_argument("--cluster", action="store_true",
                   help="the whole cluster instead, from every node agent's metrics endpoint "
                        "and Slurm: drained and suspect nodes, open incidents, held jobs, "
                        "checkpoint backlog per node, worst goodput, stragglers")
    p.set_defaults(func=run)


def collect(cfg: config.Config, node: str) -> st.StatusDoc:
    adapter = from_config(cfg)
    errors: list[str] = []
    result: st.StatusDoc = {"mode": cfg.heartbeat.mode, "drains": [], "jobs": [],
                            "incidents": [], "errors": errors}
    try:
        nodes = adapter.list_nodes()
        result["drains"] = st.drains(nodes, cfg.slurm.reason_prefix)
        result["budget"] = st.budget(nodes, cfg.slurm.reason_prefix, cfg.heartbeat, time.time())
    except SlurmError as exc:
        errors.append(f"drains: {exc}")
    try:
        result["suspicion"] = st.suspicion(
            os.path.join(node_path(cfg.node.state_dir, node), "heartbeat"), cfg.heartbeat,
            time.time())
    except PermissionError as exc:
        errors.append(f"suspicion: {exc.filename}: permission denied (root only)")
    try:
        result["jobs"] = st.hang_jobs(adapter.list_jobs())
    except SlurmError as exc:
        errors.append(f"jobs: {exc}")
    directory = st.incident_dir(node_path(cfg.node.state_dir, node),
                                node_path(cfg.heartbeat.incident_dir, node))
    try:
        result["incidents"] = st.incidents(directory)
    except PermissionError as exc:
        errors.append(f"incidents: {exc.filename}: permission denied (root only)")
    try:
        result["stragglers"] = stragglers(cfg, node, time.time())
        result["stragglers_judged"] = stragglers(cfg, node, time.time(), judged=True)
    except PermissionError as exc:
        result["stragglers"] = []
        result["stragglers_judged"] = []
        errors.append(f"stragglers: {exc.filename}: permission denied (root only)")
    result["suite_mode"] = cfg.mode
    if cfg.mode == "observe":
        from slurm_resilience import events
        from slurm_resilience.slurm import observed

        try:
            result["observed"] = observed.read(observed.path_beside(
                events.path_for(cfg.node.state_dir, node)))["decisions"]
        except (OSError, ValueError) as exc:
            errors.append(f"observed decisions: {exc}")
    if cfg.checkpoint.enabled:
        from slurm_resilience.uploader import upload_status

        uploads = upload_status.collect(upload_status.journal_dir(cfg, node))
        result["uploads"] = uploads
        errors += uploads["errors"]
    return result


def stragglers(cfg: config.Config, node: str, now: float, *, judged: bool = False
               ) -> list[dict[str, Any]]:
    """The jobs this node (ranks of it, or the whole node) was named a straggler in, within
    the record window; ``judged``: the nodes this node named as its jobs' judging agent."""
    from slurm_resilience.stragglers.record import (
        FILENAME,
        JUDGED_FILENAME,
        StragglerRecord,
        recent,
    )

    record = StragglerRecord(os.path.join(node_path(cfg.node.state_dir, node),
                                          JUDGED_FILENAME if judged else FILENAME))
    return [{"job_id": e.job_id, "ranks": list(e.ranks), "node": e.node,
             "slowdown": round(e.slowdown, 3), "at": e.at, "user": e.user}
            for e in recent(record.load(), now, cfg.stragglers.record_window_s)]


def render_stragglers(node: str, rows: list[dict[str, Any]], window_s: float,
                      judged: list[dict[str, Any]] | None = None) -> str:
    from slurm_resilience.stragglers.record import MIN_USERS

    jobs = len({r["job_id"] for r in rows})
    users = len({r.get("user") for r in rows if r.get("user")})
    # Named a recurring straggler only from jobs of several users: one user's slow ranks
    # (user code can sleep) say nothing about the node.
    tag = ""
    if users >= MIN_USERS:
        tag = f": recurring (jobs of {users} users)"
    elif jobs > 1:
        tag = (": all one user's jobs" if users else ": owners unknown") + (
            ", so not named a straggler node")
    head = f"stragglers on {node} within {window_s / 3600:g}h ({jobs} jobs){tag}:\n"
    lines = [f"  job {r['job_id']}: the whole node {r['slowdown']:+.0%} slower than the "
             f"job's other nodes\n" if r.get("node") else
             f"  job {r['job_id']}: ranks {r['ranks']} {r['slowdown']:+.0%} slower than the "
             f"job's median\n" for r in rows]
    if judged:
        lines.append(f"straggler nodes {node} named as its jobs' judge ({len(judged)}):\n")
        lines += [f"  job {r['job_id']}: {r['node']} {r['slowdown']:+.0%}\n" for r in judged]
    return head + "".join(lines)


def run(args: argparse.Namespace) -> int:
    # A broken file is reported, not fatal: status shows what the node gates with instead.
    loaded = lastgood.load(args.config)
    cfg = loaded.cfg
    if args.cluster:
        from slurm_resilience.metrics import cluster

        if not loaded.valid:
            print(f"slurm-resilience status: {loaded.problem()}", file=sys.stderr)

        view = cluster.collect(cfg)
        if args.json:
            json.dump(view.to_json(), sys.stdout, indent=1, default=str)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(cluster.render(view))
        return 1 if view.errors else 0
    node = node_name(args.node or cfg.node.name)
    result = collect(cfg, node)
    result["config"] = {"file": loaded.source, "valid": loaded.valid,
                        "error": str(loaded.error or ""), "gating_with": loaded.gating_with}
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(st.render(result))
        sys.stdout.write(render_stragglers(node, result["stragglers"],
                                           cfg.stragglers.record_window_s,
                                           result.get("stragglers_judged")))
        if "uploads" in result:
            from slurm_resilience.uploader import upload_status

            sys.stdout.write(upload_status.render(result["uploads"]))
    return 1 if result.get("errors") or not loaded.valid else 0
