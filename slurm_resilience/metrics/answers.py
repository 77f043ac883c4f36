"""What the agent answers to a login node's questions (:mod:`slurm_resilience.queries`):
its node's goodput record of a job (to any user munge vouches for: it holds times and step
counts, as public as squeue and the job_goodput metrics), and the job's hang reports (to
the job's owner and root only, as the agent socket does)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.queries.server import Handler, Refused


def handlers(cfg: Config, node: str) -> dict[str, Handler]:
    def goodput(job_id: int, uid: int) -> Mapping[str, Any]:
        from slurm_resilience.goodput.cli import node_part

        part = node_part(cfg, node, job_id)
        if part is None:
            raise Refused(f"no record of job {job_id} on {node}")
        return {"ok": True, "node": node, "ledger": part.to_json()}

    def report(job_id: int, uid: int) -> Mapping[str, Any]:
        from slurm_resilience.agent.service import Peer, RequestError
        from slurm_resilience.hang import socketapi as hang
        from slurm_resilience.hang.status import incident_dir

        incidents = incident_dir(node_path(cfg.node.state_dir, node),
                                 node_path(cfg.heartbeat.incident_dir, node))
        try:
            return hang.fetch(incidents, node, {"job_id": job_id}, Peer(-1, uid, -1),
                              cfg.heartbeat.max_report_bytes)
        except RequestError as exc:
            raise Refused(str(exc)) from None

    return {"goodput": goodput, "report": report}
