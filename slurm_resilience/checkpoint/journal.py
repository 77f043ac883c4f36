"""The agent's durable upload journal: one JSON file per job, replaced atomically.

A record holds the job's owner, staging dir and run URI, whether the job ended,
the stage-in result, and per step the upload state of every file: the multipart
upload id and each completed part with its MD5 and ETag. It is rewritten
(temp file, fsync, rename, fsync dir) after every change, so a SIGKILLed agent
restarts exactly where it stopped.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from slurm_resilience.checkpoint.commit import write_durable
from slurm_resilience.log import get_logger

log = get_logger("checkpoint.journal")
_NAME = re.compile(r"^job-(\d+)\.json$")

JobRecord = dict[str, Any]


class Journal:
    """Records keyed by job id, stored under a root-owned directory."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.lock = threading.RLock()

    def path(self, job_id: int) -> Path:
        return self.dir / f"job-{int(job_id)}.json"

    def load_all(self) -> dict[int, JobRecord]:
        out: dict[int, JobRecord] = {}
        for name in sorted(os.listdir(self.dir)):
            m = _NAME.match(name)
            if not m:
                continue
            try:
                with open(self.dir / name, encoding="utf-8") as fh:
                    rec = json.load(fh)
                if not isinstance(rec, dict) or int(rec.get("job_id", -1)) != int(m.group(1)):
                    raise ValueError("job id does not match the file name")
            except (OSError, ValueError) as exc:
                log.error("couldn't read journal record", file=name, error=str(exc))
                continue
            out[int(m.group(1))] = rec
        return out

    def write(self, rec: JobRecord) -> None:
        with self.lock:
            write_durable(self.path(int(rec["job_id"])),
                          json.dumps(rec, sort_keys=True).encode())

    def delete(self, job_id: int) -> None:
        with self.lock:
            try:
                os.unlink(self.path(job_id))
            except FileNotFoundError:
                return


def new_record(job_id: int, uid: int, gid: int, user: str, staging_root: str) -> JobRecord:
    return {"job_id": job_id, "uid": uid, "gid": gid, "user": user,
            "staging_root": staging_root, "uri": None, "state": "active",
            "ended_at": None, "stagein": {"state": "pending"}, "steps": {}}


def pending_steps(rec: JobRecord) -> list[int]:
    """Steps committed locally but not yet safe (committed and verified) in S3."""
    return sorted(int(s) for s, st in rec.get("steps", {}).items()
                  if st.get("state") not in ("committed", "rejected", "pruned"))
