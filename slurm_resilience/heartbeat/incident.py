"""The incident report: JSON plus readable text, in the job's output directory and the log.

The agent keeps its own copy in a root-owned directory (for ``slurm-resilience
status``); the job's copy is created as a new file owned by the job's user, in
the directory of the job's output file, reached without following any link.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from typing import Any

from slurm_resilience.heartbeat import safefs
from slurm_resilience.log import get_logger

log = get_logger("heartbeat.incident")


def _iso(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def base_name(job_id: int, restart: int, node: str) -> str:
    return f"hang-job{job_id}-run{restart}-{node}"


def render_text(report: Mapping[str, Any]) -> str:
    """A readable summary of a report, with every captured stack."""
    lines = [
        f"slurm-resilience hang report: job {report['job_id']} run {report['restart']} "
        f"(user {report.get('user', '?')})",
        f"detected {_iso(report.get('detected_at'))} by the agent on {report['node']}, "
        f"mode {report['mode']}",
        "",
        "Ranks:",
    ]
    for r in report.get("ranks", []):
        lines.append(
            f"  rank {r['rank']:>4} on {r['node']:<12} {r['state']:<5} step {r['step']:<8} "
            f"idle {r['idle_s']:.1f}s of {r['timeout_s']:.1f}s ({r['timeout_kind']})"
            + (f" in section {r['section']}" if r.get("section") else ""))
    blame = report.get("blame", {})
    lines += ["", f"Blame: {blame.get('explanation', 'not decided')}"]
    for node, reason in blame.get("drains", []):
        lines.append(f"  drain {node}: {reason}")
    decision = report.get("decision", {})
    lines.append(f"Decision: {decision.get('action', '-')}: {decision.get('reason', '')}")
    for action in report.get("actions", []):
        lines.append(f"  {action}")
    for node, ev in sorted(report.get("evidence", {}).items()):
        lines += ["", f"== Evidence from {node} =="]
        xids = ev.get("xids", {})
        listed = ", ".join(xids.get("findings", [])) or "none"
        lines.append("Xids since job start: " + (
            listed if xids.get("checked") else f"not checked ({xids.get('error', '')})"))
        health = ev.get("health", {})
        lines.append("Health: " + (
            ("failed: " + "; ".join(health["failures"])) if health.get("failures")
            else "ok" if health.get("checked") else f"not checked ({health.get('error', '')})"))
        for r in ev.get("ranks", []):
            lines.append(f"-- rank {r['rank']} pid {r['pid']} --")
            if r.get("stack"):
                lines.append(r["stack"].rstrip())
            else:
                lines.append(f"(no stack: {r.get('stack_error', '')})")
            trace = r.get("nccl_trace", {})
            if trace.get("enabled"):
                lines.append("NCCL flight recorder: " + (
                    f"{trace['bytes']} bytes sha256 {trace['sha256']}" if "bytes" in trace
                    else trace.get("error", "")))
    return "\n".join(lines) + "\n"


def write_agent_copy(directory: str, report: Mapping[str, Any]) -> str:
    """Write the report into the agent's root-owned incident directory; returns the path."""
    fd = safefs.makedirs_root(directory)
    name = base_name(report["job_id"], report["restart"], report["node"])
    try:
        for suffix, data in ((".json", json.dumps(report, indent=1, default=str).encode()),
                             (".txt", render_text(report).encode())):
            safefs.replace_file(fd, name + suffix, data)
    finally:
        os.close(fd)
    return os.path.join(directory, name + ".json")


def write_job_copy(std_out: str, uid: int, gid: int, report: Mapping[str, Any]) -> str:
    """Write the report beside the job's output file, as the job user's own new files."""
    directory = os.path.dirname(std_out)
    if not std_out or not os.path.isabs(std_out):
        raise safefs.UnsafePath(0, f"job output path {std_out!r} is not absolute")
    fd = safefs.open_dir(directory)
    try:
        st = os.fstat(fd)
        # The user's own directory, or a shared sticky one such as /tmp (O_EXCL|O_NOFOLLOW
        # creation is safe there; nothing existing is ever opened).
        if not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
            safefs.check_owned_dir(fd, uid, private=False, what=directory)
        name = f"slurm-resilience-{base_name(report['job_id'], report['restart'], report['node'])}"
        safefs.write_new(fd, name + ".json", json.dumps(report, indent=1, default=str).encode(),
                         uid=uid, gid=gid, mode=0o600)
        safefs.write_new(fd, name + ".txt", render_text(report).encode(), uid=uid, gid=gid,
                         mode=0o600)
    finally:
        os.close(fd)
    return os.path.join(directory, name + ".txt")


def list_reports(directory: str, limit: int = 50) -> list[dict[str, Any]]:
    """The newest reports in the agent's incident directory (for status)."""
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".json")]
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names, key=lambda n: os.path.getmtime(os.path.join(directory, n)),
                       reverse=True)[:limit]:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            out.append({"file": name, "error": f"couldn't read: {exc}"})
            continue
        if isinstance(data, dict):
            out.append(data)
    return out
