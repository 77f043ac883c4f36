"""The watcher's socket requests, each checked against the peer's kernel credentials
(SO_PEERCRED): a user sees, reports and fetches only their own jobs; root sees all.

* ``hang.status``: jobs watched on this node;
* ``hang.report``: a job's own process reports a stall it detected itself;
* ``hang.fetch``: the incident reports this node's agent keeps for a job (JSON and text),
  bounded by ``heartbeat.max_report_bytes``; ``slurm-resilience report JOBID`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from slurm_resilience.agent.service import Peer, Request, RequestError, Response
from slurm_resilience.hang import incident
from slurm_resilience.hang.localpiece import JobView


def job_id_of(value: object, what: str = "job_id") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
        raise RequestError(f"{what} must be a job id (digits), got {value!r}")
    return int(str(value))


def owned(views: dict[int, JobView], node: str, request: Request, peer: Peer) -> JobView:
    """The caller's own job (root: any); the same refusal whether the job is not watched here
    or is someone else's, so no answer tells who runs what."""
    job_id = job_id_of(request.get("job_id"))
    view = views.get(job_id)
    if view is None or peer.uid not in (0, view.record.uid):
        raise RequestError(f"no job {job_id} of uid {peer.uid} is watched on {node}")
    return view


def status(views: list[JobView], node: str, mode: str, peer: Peer,
           suspect: Mapping[str, object]) -> Response:
    jobs = []
    for v in views:
        if peer.uid not in (0, v.record.uid):
            continue
        jobs.append({"job_id": v.record.job_id, "user": v.record.user,
                     "mode": v.verdict.mode, "stragglers": list(v.verdict.stragglers),
                     "tuned_timeout_s": v.verdict.tuned_timeout_s,
                     "ranks": [r.__dict__ for r in v.verdict.ranks], "errors": v.errors})
    out: Response = {"ok": True, "node": node, "mode": mode, "jobs": jobs}
    if peer.uid == 0:
        out["last_verification"] = suspect
    return out


def fetch(incident_dir: str, node: str, request: Request, peer: Peer,
          max_bytes: int) -> Response:
    """The job's reports on this node, for its owner or root; the same refusal whether the
    job had no incident here or belongs to someone else, so nothing leaks about others."""
    job_id = job_id_of(request.get("job_id"))
    reports = [r for r in incident.reports_of_job(incident_dir, job_id)
               if peer.uid in (0, r.get("uid"))]
    if not reports:
        raise RequestError(f"no hang report of job {job_id} for uid {peer.uid} on {node}")
    texts: list[str] = []
    used = 0
    truncated = False
    for rep in reversed(reports):  # newest first, so the latest run always fits
        text = incident.render_text(rep)
        if used + len(text) > max_bytes:
            text = text[: max(0, max_bytes - used)]
            truncated = True
        texts.insert(0, text)
        used += len(text)
        if truncated:
            break
    return {"ok": True, "node": node, "job_id": job_id, "text": "".join(texts),
            "runs": [r.get("restart") for r in reports], "truncated": truncated}


Starter = Callable[[JobView, str], bool]
