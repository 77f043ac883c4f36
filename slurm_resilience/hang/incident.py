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

from slurm_resilience import safefs
from slurm_resilience.hang.incidentrecords import ReportDoc
from slurm_resilience.log import escape, get_logger

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


def _e(value: Any) -> str:
    """A value that came from a job (paths, names, stacks): one printable line, so no
    newline, escape sequence or bidi override a user wrote reaches the reader's terminal."""
    return escape(str(value))


def render_text(report: Mapping[str, Any]) -> str:
    """A readable summary of a report, with every captured stack. Every value is escaped
    (a user controls paths, names and what their stacks print); each stack line is indented
    under its rank, so none can pass for a line of the report."""
    lines = [
        f"slurm-resilience hang report: job {_e(report['job_id'])} run "
        f"{_e(report['restart'])} (user {_e(report.get('user', '?'))})",
        f"detected {_iso(report.get('detected_at'))} by the agent on {_e(report['node'])}, "
        f"mode {_e(report['mode'])}",
        "",
        "Ranks:",
    ]
    for r in report.get("ranks", []):
        lines.append(
            f"  rank {r['rank']:>4} on {_e(r['node']):<12} {_e(r['state']):<5} "
            f"step {r['step']:<8} idle {r['idle_s']:.1f}s of {r['timeout_s']:.1f}s "
            f"({_e(r['timeout_kind'])})"
            + (f" in section {_e(r['section'])}" if r.get("section") else ""))
    blame = report.get("blame", {})
    lines += ["", f"Blame: {_e(blame.get('explanation', 'not decided'))}"]
    decision = report.get("decision", {})
    for call in decision.get("nodes", []):
        lines.append(f"  {_e(call['verdict'])} {_e(call['node'])}: {_e(call['reason'])}")
    if decision.get("budget"):
        lines.append(f"  {_e(decision['budget'])}")
    lines.append(f"Decision: {_e(decision.get('action', '-'))}: "
                 f"{_e(decision.get('reason', ''))}")
    for action in report.get("actions", []):
        lines.append(f"  {_e(action)}")
    lines.append(f"Time this hang cost the job: slurm-resilience goodput "
                 f"{_e(report['job_id'])} (on {_e(report['node'])})")
    for node, ev in sorted(report.get("evidence", {}).items()):
        lines += ["", f"== Evidence from {_e(node)} =="]
        xids = ev.get("xids", {})
        listed = ", ".join(_e(x) for x in xids.get("findings", [])) or "none"
        lines.append("Xids since job start: " + (
            listed if xids.get("checked") else f"not checked ({_e(xids.get('error', ''))})"))
        health = ev.get("health", {})
        lines.append("Health: " + (
            ("failed: " + "; ".join(_e(f) for f in health["failures"]))
            if health.get("failures") else "ok" if health.get("checked")
            else f"not checked ({_e(health.get('error', ''))})"))
        for r in ev.get("ranks", []):
            lines.append(f"-- rank {_e(r['rank'])} pid {_e(r['pid'])} --")
            if r.get("stack"):
                lines.extend(f"  {_e(line)}" for line in str(r["stack"]).rstrip().split("\n"))
            else:
                lines.append(f"(no stack: {_e(r.get('stack_error', ''))})")
            trace = r.get("nccl_trace", {})
            if trace.get("enabled"):
                lines.append("NCCL flight recorder: " + (
                    f"{_e(trace['bytes'])} bytes sha256 {_e(trace['sha256'])}"
                    if "bytes" in trace else _e(trace.get("error", ""))))
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
