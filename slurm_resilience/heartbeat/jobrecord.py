"""The root-owned record of a job on a node, written by the prolog, read by the agent.

It is the agent's only source for who owns a job: nothing inside the user's
run directory is trusted for that.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from slurm_resilience.heartbeat import safefs
from slurm_resilience.heartbeat.paths import job_id_of_record


@dataclass(frozen=True)
class JobRecord:
    """A job running on this node."""

    job_id: int
    uid: int
    gid: int
    user: str
    started: float  # Unix time of the prolog
    nodes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["nodes"] = list(self.nodes)
        return data


def from_json(data: Any) -> JobRecord:
    if not isinstance(data, dict):
        raise ValueError("job record is not a JSON object")
    return JobRecord(job_id=int(data["job_id"]), uid=int(data["uid"]), gid=int(data["gid"]),
                     user=str(data.get("user", "")), started=float(data["started"]),
                     nodes=tuple(str(n) for n in data.get("nodes", [])))


def write(records_dir: str, record: JobRecord) -> None:
    """Atomically (re)write the record in the root-owned records directory."""
    fd = safefs.makedirs_root(records_dir, 0o700)
    try:
        safefs.replace_file(fd, f"{record.job_id}.json", json.dumps(record.to_json()).encode())
    finally:
        os.close(fd)


def remove(records_dir: str, job_id: int) -> None:
    try:
        fd = safefs.open_dir(records_dir)
    except FileNotFoundError:
        return
    try:
        os.unlink(f"{int(job_id)}.json", dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def read_all(records_dir: str) -> tuple[list[JobRecord], list[str]]:
    """Every record on this node, and an error line per unreadable one."""
    try:
        fd = safefs.open_dir(records_dir)
    except FileNotFoundError:
        return [], []
    records: list[JobRecord] = []
    errors: list[str] = []
    try:
        safefs.check_owned_dir(fd, os.geteuid(), private=False, what=records_dir)
        for name in os.listdir(fd):
            if job_id_of_record(name) is None:
                continue
            try:
                data = safefs.read_owned_file(fd, name, os.geteuid(), max_bytes=1 << 20)
                records.append(from_json(json.loads(data)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                errors.append(f"{records_dir}/{name}: {exc}")
    finally:
        os.close(fd)
    return records, errors
