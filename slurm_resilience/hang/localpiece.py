"""This node's piece of an incident: its ranks, stalled-rank observations with their stacks,
and the node's own fresh findings (Xids since the job started, failed health checks)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import cast

from slurm_resilience import safefs
from slurm_resilience.config import Config
from slurm_resilience.hang import blame as B
from slurm_resilience.hang import detect, evidence, jobrecord
from slurm_resilience.hang.incidentrecords import Piece, RankLine
from slurm_resilience.heartbeat import slot as S
from slurm_resilience.log import get_logger

log = get_logger("heartbeat.piece")


@dataclass
class JobView:
    """The latest reading of one job on this node."""

    record: jobrecord.JobRecord
    slots: list[S.SlotView]
    verdict: detect.JobVerdict
    errors: list[str] = field(default_factory=list)
    read_at: float = 0.0


def rank_lines(view: JobView, node: str) -> tuple[RankLine, ...]:
    states = {r.rank: r for r in view.verdict.ranks}
    return tuple(
        RankLine(v.rank, node, states[v.rank].state, v.step, states[v.rank].idle_s,
                 states[v.rank].timeout_s, states[v.rank].timeout_kind, states[v.rank].section,
                 v.pid, round(v.ewma_dt, 4), round(v.max_dt, 4), v.wall(v.last_progress))
        for v in sorted(view.slots, key=lambda s: s.rank) if v.rank in states)


def capture(cfg: Config, node: str, view: JobView, trigger: str, incident_dir: str,
            now: float) -> Piece:
    """Evidence and observations of this node's ranks, and the node's own checks, all within
    evidence_timeout_s (see :func:`evidence.capture_ranks_bounded`)."""
    hb = cfg.heartbeat
    rec = view.record
    states = {r.rank: r.state for r in view.verdict.ranks}
    stalled = [v for v in view.slots if states.get(v.rank) not in ("done", "dead")]
    files_dir = os.path.join(incident_dir, "files")
    save_fd: int | None = None
    try:
        save_fd = safefs.makedirs_root(files_dir)
    except OSError as exc:
        log.warning("heartbeat: evidence: couldn't create incident file directory",
                    path=files_dir, error=str(exc))
    checks: dict[str, evidence.NodeCheck] = {
        "xids": lambda left: evidence.xids_since(cfg, node, rec.started, left),
        "health": lambda left: evidence.health_snapshot(cfg, node, left)}
    try:
        outcome = evidence.capture_ranks_bounded(
            stalled, rec.uid, py_spy=evidence.find_py_spy(hb.py_spy),
            timeout=hb.evidence_timeout_s, save_dir_fd=save_fd, node_checks=checks,
            # The run as the slots say (Slurm is read later): a user can only make their own
            # job's names collide, and a taken name is never reused.
            save_prefix=evidence.trace_prefix(
                rec.job_id, max((v.restart_count for v in view.slots), default=0), node))
    finally:
        if save_fd is not None:
            os.close(save_fd)
    ranks_ev = outcome.ranks
    xids = cast(evidence.XidsDoc, outcome.node["xids"])
    health = cast(evidence.HealthDoc, outcome.node["health"])
    stacks = {e.rank: e.stack for e in ranks_ev}
    obs = tuple(B.RankObservation(v.rank, node, v.step, v.wall(v.last_progress),
                                  B.in_collective(stacks.get(v.rank, "")), v.ewma_dt)
                for v in stalled)
    return Piece(node, trigger, now, rank_lines(view, node), obs,
                 tuple(evidence.node_findings(xids, health)),
                 {"ranks": [e.to_json() for e in ranks_ev], "xids": xids, "health": health,
                  "slot_ckpt_step": max((v.ckpt_step for v in view.slots), default=-1)})
