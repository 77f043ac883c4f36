"""Where a job's heartbeat slots and the agent's per-job records live on a node.

* ``<node.run_dir>/job-<id>/``: the job's run directory, created by the prolog,
  owned by the job's user, mode 0700. Only that user can create or write slots.
* ``<node.run_dir>/jobs/<id>.json``: root-owned record of the job (uid, user,
  start time, nodes), written by the prolog; the agent trusts only this, never
  anything inside the user's directory, for who owns the job.
"""

from __future__ import annotations

import os
import re

from slurm_resilience.config.paths import node_path

_JOB_DIR = re.compile(r"^job-(\d{1,12})$")
_JOB_RECORD = re.compile(r"^(\d{1,12})\.json$")

ENV_RUN_DIR = "SLURM_RESILIENCE_RUN_DIR"


def run_root(run_dir_template: str, node: str) -> str:
    return node_path(run_dir_template, node)


def job_dir(run_dir_template: str, node: str, job_id: int) -> str:
    return os.path.join(run_root(run_dir_template, node), f"job-{int(job_id)}")


def records_dir(run_dir_template: str, node: str) -> str:
    return os.path.join(run_root(run_dir_template, node), "jobs")


def record_path(run_dir_template: str, node: str, job_id: int) -> str:
    return os.path.join(records_dir(run_dir_template, node), f"{int(job_id)}.json")


def job_id_of_record(name: str) -> int | None:
    m = _JOB_RECORD.match(name)
    return int(m.group(1)) if m else None
