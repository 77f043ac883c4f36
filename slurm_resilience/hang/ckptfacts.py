"""Checkpoint progress of a job as root knows it, for the requeue guard.

The source is the checkpoint agent's own journal on this node (root-owned): the steps it
saw committed in the job's staging directory, uploaded and verified in S3, or staged in.
The ``ckpt_step`` a rank writes into its heartbeat slot is the user's word and is shown in
the report only: it never decides whether a job is requeued.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from slurm_resilience import safefs
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path

# A rejected step failed verification; every other state was a committed step once.
_NOT_COMMITTED = ("rejected",)


@dataclass(frozen=True)
class CheckpointFact:
    step: int  # -1: none known
    source: str


def journal_dir(cfg: Config, node: str) -> str:
    configured = cfg.checkpoint.journal_dir
    return node_path(configured, node) if configured else os.path.join(
        node_path(cfg.node.state_dir, node), "ckpt-journal")


def committed_step(cfg: Config, node: str, job_id: int) -> CheckpointFact:
    """The newest step the checkpoint agent recorded as committed for the job, or -1."""
    directory = journal_dir(cfg, node)
    try:
        fd = safefs.open_dir(directory)
    except FileNotFoundError:
        return CheckpointFact(-1, f"no checkpoint journal on {node}")
    except OSError as exc:
        return CheckpointFact(-1, f"couldn't open checkpoint journal: {exc}")
    try:
        raw = safefs.read_owned_file(fd, f"job-{int(job_id)}.json", os.geteuid(),
                                     max_bytes=16 << 20)
        rec = json.loads(raw)
        steps = rec.get("steps", {}) if isinstance(rec, dict) else {}
        done = [int(s) for s, st in steps.items()
                if str(s).isdigit() and isinstance(st, dict)
                and st.get("state") not in _NOT_COMMITTED]
    except FileNotFoundError:
        return CheckpointFact(-1, f"no checkpoint journal record of job {job_id} on {node}")
    except (OSError, ValueError, AttributeError) as exc:
        return CheckpointFact(-1, f"couldn't read checkpoint journal of job {job_id}: {exc}")
    finally:
        os.close(fd)
    return CheckpointFact(max(done, default=-1), f"checkpoint journal on {node}")
