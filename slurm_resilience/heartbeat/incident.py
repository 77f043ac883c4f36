"""The incident report: JSON plus readable text, kept by the agent, and the log.

The agent keeps reports in its own root-owned directory (``<node.state_dir>/incidents``).
Root never writes into a directory a job's fields name (its output path can point anywhere,
sits on a root-squashed filesystem, or is hidden from the agent by ProtectHome/PrivateTmp):
the job's user fetches their reports through the agent socket with
``slurm-resilience report JOBID``, which checks the caller's kernel credentials.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from slurm_resilience.heartbeat import safefs
from slurm_resilience.heartbeat.records import ReportDoc
from slurm_resilience.log import get_logger

log = get_logger("heartbeat.incident")

MAX_REPORT_FILE = 4 << 20


@dataclass(frozen=True)
class Listed:
    """A report file of the incident directory: its report, or why it can't be used."""

    file: str
    report: ReportDoc | None
    error: str = ""


def check_report(data: object, name: str) -> ReportDoc:
    """A report as every release wrote it: ValueError naming the field otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"{name} is not a report")
    for key, kind, what in (("job_id", int, "an integer"), ("restart", int, "an integer"),
                            ("node", str, "a string"), ("mode", str, "a string")):
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            raise ValueError(f"{name}: {key} {data.get(key)!r} is not {what}")
    # The fields readers index into must have their shape too.
    for key, shape in (("decision", dict), ("blame", dict), ("files", list), ("actions", list),
                       ("ranks", list)):
        if data.get(key) is not None and not isinstance(data[key], shape):
            raise ValueError(f"{name}: {key} is a {type(data[key]).__name__}, not a "
                             f"{shape.__name__}")
    return cast(ReportDoc, data)


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
    decision = report.get("decision", {})
    for call in decision.get("nodes", []):
        lines.append(f"  {call['verdict']} {call['node']}: {call['reason']}")
    if decision.get("budget"):
        lines.append(f"  {decision['budget']}")
    lines.append(f"Decision: {decision.get('action', '-')}: {decision.get('reason', '')}")
    for action in report.get("actions", []):
        lines.append(f"  {action}")
    lines.append(f"Time this hang cost the job: slurm-resilience goodput {report['job_id']} "
                 f"(on {report['node']})")
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


def write_agent_copy(directory: str, report: ReportDoc) -> str:
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


def read_report(directory: str, name: str) -> ReportDoc:
    """One report of the agent's root-owned incident directory (never through a link)."""
    fd = safefs.open_dir(directory)
    try:
        raw = safefs.read_owned_file(fd, name, os.geteuid(), max_bytes=MAX_REPORT_FILE)
    finally:
        os.close(fd)
    return check_report(json.loads(raw), name)


def reports_of_job(directory: str, job_id: int, limit: int = 8) -> list[ReportDoc]:
    """This node's reports of one job, oldest run first (at most ``limit``)."""
    prefix = f"hang-job{int(job_id)}-run"
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n.startswith(prefix) and n.endswith(".json"))
    except FileNotFoundError:
        return []
    out = []
    for name in names[-limit:]:
        try:
            out.append(read_report(directory, name))
        except (OSError, ValueError) as exc:
            log.warning("heartbeat: report: couldn't read report", file=name, error=str(exc))
    return sorted(out, key=lambda r: (int(r.get("restart", 0)), str(r.get("node", ""))))


def list_reports(directory: str, limit: int = 50) -> list[Listed]:
    """The newest reports in the agent's incident directory (for status)."""
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".json")]
    except FileNotFoundError:
        return []
    out: list[Listed] = []
    for name in sorted(names, key=lambda n: os.path.getmtime(os.path.join(directory, n)),
                       reverse=True)[:limit]:
        try:
            out.append(Listed(name, read_report(directory, name)))  # bounded, no link
        except (OSError, ValueError) as exc:
            out.append(Listed(name, None, f"couldn't read: {exc}"))
    return out
