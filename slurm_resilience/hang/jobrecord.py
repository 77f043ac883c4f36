"""The root-owned record of a job on a node, written by the prolog, read by the agent.

It is the agent's only source for who owns a job: nothing inside the user's
run directory is trusted for that.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TypedDict

from slurm_resilience import safefs
from slurm_resilience.heartbeat.paths import job_id_of_record


class JobRecordDoc(TypedDict):
    """``<records_dir>/<job_id>.json``."""

    job_id: int
    uid: int
    gid: int
    user: str
    started: float
    nodes: list[str]


@dataclass(frozen=True)
class JobRecord:
    """A job running on this node."""

    job_id: int
    uid: int
    gid: int
    user: str
    started: float  # Unix time of the prolog
    nodes: tuple[str, ...] = ()

    def to_json(self) -> JobRecordDoc:
        return {"job_id": self.job_id, "uid": self.uid, "gid": self.gid, "user": self.user,
                "started": self.started, "nodes": list(self.nodes)}


def _int(data: dict[str, object], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"job record: {key} {value!r} is not a non-negative integer")
    return value


def from_json(data: object) -> JobRecord:
    """A record as :func:`write` wrote it; ValueError naming the field otherwise."""
    if not isinstance(data, dict):
        raise ValueError("job record is not a JSON object")
    started, user, nodes = data.get("started"), data.get("user", ""), data.get("nodes", [])
    if not isinstance(started, (int, float)) or isinstance(started, bool):
        raise ValueError(f"job record: started {started!r} is not a time")
    if not isinstance(user, str):
        raise ValueError(f"job record: user {user!r} is not a string")
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ValueError("job record: nodes is not a list of node names")
    return JobRecord(job_id=_int(data, "job_id"), uid=_int(data, "uid"), gid=_int(data, "gid"),
                     user=user, started=float(started), nodes=tuple(nodes))


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
