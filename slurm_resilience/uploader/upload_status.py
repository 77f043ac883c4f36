"""What ``slurm-resilience status`` says about this node's checkpoint uploads.

Reads the agent's journal without changing it: steps that will never reach S3
(refused by S3 for good, or refused by us) with their reason, jobs whose upload
work failed, pending steps, and records the agent quarantined.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypedDict

from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.uploader.journal import (
    MAX_RECORD_BYTES,
    BadRecord,
    JobState,
    check_record,
    failed_steps,
    pending_steps,
)


class JobUploads(TypedDict):
    job_id: int
    user: str
    uri: str | None
    state: str
    pending: list[int]
    failed: dict[str, str]  # step -> reason
    error: str | None


class UploadReport(TypedDict):
    jobs: list[JobUploads]
    quarantined: list[str]
    errors: list[str]


def journal_dir(cfg: Config, node: str) -> Path:
    ck = cfg.checkpoint
    return Path(node_path(ck.journal_dir or os.path.join(cfg.node.state_dir, "ckpt-journal"),
                          node))


def collect(directory: Path) -> UploadReport:
    """Jobs with something to report (pending, failed steps, a failed job)."""
    report: UploadReport = {"jobs": [], "quarantined": [], "errors": []}
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return report
    except PermissionError:
        report["errors"].append(f"uploads: {directory}: permission denied (root only)")
        return report
    quarantine = directory / "quarantine"
    if quarantine.is_dir():
        report["quarantined"] = sorted(os.listdir(quarantine))
    for name in names:
        if not (name.startswith("job-") and name.endswith(".json")):
            continue
        try:
            job_id = int(name[4:-5])
            with open(directory / name, "rb") as fh:
                rec, _ = check_record(json.loads(fh.read(MAX_RECORD_BYTES)), job_id)
        except (OSError, ValueError, BadRecord) as exc:
            report["errors"].append(f"uploads: {name}: couldn't read: {exc}")
            continue
        failed = {str(k): v for k, v in failed_steps(rec).items()}
        pending = pending_steps(rec)
        if failed or pending or rec["state"] == JobState.FAILED:
            report["jobs"].append({"job_id": job_id, "user": rec["user"], "uri": rec["uri"],
                                   "state": rec["state"], "pending": pending, "failed": failed,
                                   "error": rec.get("error")})
    return report


def render(report: UploadReport) -> str:
    lines = []
    for job in report["jobs"]:
        head = f"  job {job['job_id']} ({job['user']}) {job['uri'] or 'local only'}"
        if job["state"] == JobState.FAILED:
            head += f": upload work failed: {job['error']}"
        lines.append(head)
        if job["pending"]:
            lines.append(f"    pending steps: {', '.join(map(str, job['pending']))}")
        for step, why in sorted(job["failed"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"    step {step} not uploaded: {why}")
    if report["quarantined"]:
        lines.append(f"  quarantined journal records: {', '.join(report['quarantined'])}")
    if not lines:
        return "Checkpoint uploads: nothing pending or failed\n"
    return "Checkpoint uploads:\n" + "\n".join(lines) + "\n"
