"""What the suite did, from Slurm's point of view plus this node's incident reports.

Drains carrying our prefix, jobs whose AdminComment holds our hang ledger
(requeued or held, with the reason), and the incident reports this node's
agent wrote. Pure assembly here; :mod:`slurm_resilience.statuscli` prints it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.hang import incident, policy
from slurm_resilience.hang import requeue as R
from slurm_resilience.hang import suspect as S
from slurm_resilience.hang.suspect import DeepDoc
from slurm_resilience.slurm import observed
from slurm_resilience.slurm.observed import Decision
from slurm_resilience.slurm.parse import JobInfo, NodeInfo

if TYPE_CHECKING:
    from slurm_resilience.uploader.upload_status import UploadReport


class DrainRow(TypedDict):
    node: str
    state: str
    reason: str
    since: str  # Slurm's reason time, as Slurm prints it
    hang: bool


class BudgetRow(TypedDict):
    used: int
    limit: int
    by_user: dict[str, int]
    per_user_limit: int
    spent: bool


class SuspicionRow(TypedDict):
    """Suspicion of this node by hang handling: never a drain by itself (see suspect.py)."""

    users: int  # different users whose jobs suspected it within the window
    jobs: list[str]  # "JOB(USER)"
    window_s: float
    threshold: int  # users at which it gets the deeper verification
    last_deep: DeepDoc | None


class HangJobRow(TypedDict):
    job_id: int
    user: str
    state: str
    reason: str
    restarts: int
    hang_requeues: int
    held: bool
    admin_comment: str


class IncidentRow(TypedDict, total=False):
    """One report's summary, or (``file`` and ``error`` only) a report that can't be read."""

    job_id: int | None
    run: int | None
    node: str | None
    mode: str | None
    detected_at: float | None
    action: str | None
    reason: str | None
    blame: str
    files: list[str]
    file: str
    error: str


class ConfigRow(TypedDict):
    """Whether the configuration file loads, and what the node gates with if not."""

    file: str
    valid: bool
    error: str
    gating_with: str


class StatusDoc(TypedDict, total=False):
    """``slurm-resilience status --json``."""

    config: ConfigRow
    suite_mode: str  # enforce | observe
    observed: list[Decision]  # what observe mode would have done on this node
    mode: str
    drains: list[DrainRow]
    budget: BudgetRow
    suspicion: SuspicionRow
    jobs: list[HangJobRow]
    incidents: list[IncidentRow]
    errors: list[str]
    uploads: UploadReport
    stragglers: list[dict[str, Any]]
    stragglers_judged: list[dict[str, Any]]


def drains(nodes: Sequence[NodeInfo], prefix: str) -> list[DrainRow]:
    """Nodes drained or down with a reason we set."""
    return [{"node": n.name, "state": "+".join([n.state, *sorted(n.flags)]), "reason": n.reason,
             # Reasons of earlier releases ("SR: hang job 7: ...") are hang drains too.
             "since": n.reason_time,
             "hang": policy.parse_reason(n.reason) is not None or "hang job" in n.reason}
            for n in nodes if (n.drained or n.down) and n.reason.startswith(prefix)]


def budget(nodes: Sequence[NodeInfo], prefix: str, hb: HeartbeatSection, now: float
           ) -> BudgetRow:
    """How much of the hourly hang budget (suspect take-outs) is used, from Slurm's nodes."""
    used = policy.budget_used(nodes, prefix, now)
    return {"used": used.total, "limit": hb.budget_per_hour, "by_user": dict(used.by_user),
            "per_user_limit": hb.budget_per_user_per_hour, "spent": used.total
            >= hb.budget_per_hour}


def suspicion(heartbeat_dir: str, hb: HeartbeatSection, now: float) -> SuspicionRow:
    """This node's suspicion history within the window and its last deeper verification,
    from the agent's state (``heartbeat_dir``: ``<node.state_dir>/heartbeat``)."""
    items = S.SuspectHistory(os.path.join(heartbeat_dir, S.HISTORY_FILE)).load()
    recent = [(j, u) for at, j, u in items if now - at <= hb.suspect_window_s]
    return {"users": S.users_within(items, now, hb.suspect_window_s),
            "jobs": [f"{j}({u})" for j, u in recent], "window_s": hb.suspect_window_s,
            "threshold": hb.suspect_threshold,
            "last_deep": S.load_deep(os.path.join(heartbeat_dir, S.DEEP_FILE))}


def hang_jobs(jobs: Sequence[JobInfo]) -> list[HangJobRow]:
    """Jobs with a hang ledger: requeue count, and whether they are held and why."""
    out: list[HangJobRow] = []
    for j in jobs:
        ledger = R.parse_ledger(j.admin_comment)
        if ledger is None:
            continue
        held = j.state == "PENDING" and "held" in j.reason.lower()
        out.append({"job_id": j.job_id, "user": j.user, "state": j.state, "reason": j.reason,
                    "restarts": j.restarts, "hang_requeues": ledger.requeues,
                    "held": held, "admin_comment": j.admin_comment})
    return out


def incidents(directory: str, limit: int = 20) -> list[IncidentRow]:
    """Summaries of this node's newest incident reports."""
    out: list[IncidentRow] = []
    for listed in incident.list_reports(directory, limit):
        rep = listed.report
        if rep is None:
            out.append({"file": listed.file, "error": listed.error})
            continue
        decision = rep.get("decision", {})
        out.append({
            "job_id": rep.get("job_id"), "run": rep.get("restart"), "node": rep.get("node"),
            "mode": rep.get("mode"), "detected_at": rep.get("detected_at"),
            "action": decision.get("action"), "reason": decision.get("reason"),
            "blame": rep.get("blame", {}).get("explanation", ""),
            "files": rep.get("files", []),
        })
    return out


def render(status: StatusDoc) -> str:
    """Readable text of :func:`collect`'s result."""
    lines = []
    c = status.get("config")
    if c:
        lines.append(f"config: {c['file']}: valid" if c["valid"] else
                     f"config: INVALID: {c['error']}; gating with {c['gating_with']} "
                     "(fix the file; `slurm-resilience config check` shows the error)")
    if status.get("suite_mode") == "observe":
        seen = status.get("observed", [])
        lines.append(f"mode observe: acting on nothing; {len(seen)} decision(s) not carried "
                     "out" + (":" if seen else ""))
        lines += [f"  {observed.line(d)} (at {_hhmmss(d['first'])}"
                  + (f", {d['times']} times, last {_hhmmss(d['last'])}" if d["times"] > 1
                     else "") + ")" for d in seen]
    lines.append(f"hang watching: mode {status['mode']}")
    b = status.get("budget")
    if b:
        users = ", ".join(f"{u} {n}" for u, n in sorted(b["by_user"].items())) or "none"
        lines.append(f"hang budget: {b['used']} of {b['limit']} suspect take-outs this hour"
                     + (" (SPENT: suspects are reported, not taken out; drains on evidence "
                        "go on)" if b["spent"] else "")
                     + f"; per user (limit {b['per_user_limit']}): {users}")
    sus = status.get("suspicion")
    if sus and sus["jobs"]:
        lines.append(f"suspicion of this node: jobs of {sus['users']} users within "
                     f"{sus['window_s'] / 3600:g}h ({', '.join(sus['jobs'][-8:])}); deeper "
                     f"verification from {sus['threshold']} users; never a drain without a "
                     "failed check")
    deep = sus.get("last_deep") if sus else None
    if deep:
        lines.append(f"  last deeper verification at {_hhmmss(deep['at'])}, suspected by "
                     f"{deep['users']} users' jobs: "
                     + ("passed" if deep["passed"] else "FAILED") + f": {deep['outcome']}; "
                     + "; ".join(deep["checks"]))
    drained, jobs, reports = (status.get("drains", []), status.get("jobs", []),
                              status.get("incidents", []))
    lines.append(f"drains by slurm-resilience ({len(drained)}):")
    lines += [f"  {d['node']:<14} {d['state']:<14} {d['reason']}" for d in drained]
    lines.append(f"jobs requeued or held for hangs ({len(jobs)}):")
    for j in jobs:
        tag = "HELD" if j["held"] else j["state"]
        lines.append(f"  job {j['job_id']:<8} {j['user']:<10} {tag:<9} hang requeues "
                     f"{j['hang_requeues']}  {j['admin_comment']}")
    lines.append(f"incidents on this node ({len(reports)}):")
    for i in reports:
        if "error" in i and "job_id" not in i:
            lines.append(f"  {i.get('file')}: {i['error']}")
            continue
        lines.append(f"  job {i.get('job_id')} run {i.get('run')} on {i.get('node')}: "
                     f"{i.get('action')}: {i.get('reason')}")
        if i.get("blame"):
            lines.append(f"      blame: {i['blame']}")
    for err in status.get("errors", []):
        lines.append(f"could not check: {err}")
    return "\n".join(lines) + "\n"


def incident_dir(state_dir: str, configured: str) -> str:
    return configured or os.path.join(state_dir, "incidents")


def _hhmmss(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))
