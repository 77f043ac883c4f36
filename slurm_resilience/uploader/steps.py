"""Prolog and epilog steps of checkpoint staging (light imports: no torch, no boto3)."""

from __future__ import annotations

import time

from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call, list_field
from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.checkpoint.staging import (
    clean_tmp,
    create_job_dir,
    remove_job_dir,
    set_aside_job_dir,
)
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config.budgets import epilog_remove_s
from slurm_resilience.config.paths import node_path
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalBudget, RemovalIncomplete

log = get_logger("checkpoint.hooks")


def prolog(ctx: HookContext, *, clock: Clock = SystemClock()) -> list[Problem]:
    """Create the job's staging dir (owner = job user, 0700, no links) and tell the agent.

    An agent that can't be reached fails at once; one that stays busy (over its caps) is
    tried again until ``agent.request_timeout_s`` (a share of the prolog's budget, see
    config.budgets), read and slept on ``clock``. Either way the job runs and the log says
    why it gets no stage-in."""
    ck = ctx.cfg.checkpoint
    if not ck.enabled or ctx.job_id is None or ctx.uid is None:
        return []
    root = node_path(ck.staging_root, ctx.node)
    gid = ctx.gid if ctx.gid is not None else ctx.uid
    try:
        create_job_dir(root, ctx.job_id, ctx.uid, gid)
    except (CheckpointError, OSError) as exc:
        return [Problem("checkpoint", f"ckpt staging dir under {root} unusable: {exc}")]
    try:
        # With the SPANK option --ckpt-uri the agent starts staging in right now, while
        # Slurm launches the tasks; otherwise when the job registers its URI.
        answer = call(node_path(ctx.cfg.agent.socket, ctx.node), "ckpt.job_start",
                      timeout=ctx.cfg.agent.request_timeout_s, clock=clock,
                      job_id=ctx.job_id, uid=ctx.uid, gid=gid, user=ctx.user,
                      uri=ctx.job_option("CKPT_URI"))
        if answer.get("refused"):
            log.warning("prolog: --ckpt-uri refused", error=answer["refused"])
    except AgentRefused as exc:
        log.warning("prolog: the agent refused the job; it runs without stage-in or S3 "
                    "sync of its checkpoints", error=str(exc), job_id=ctx.job_id)
    except AgentUnavailable as exc:
        # Not a drain: an agent that is down or flooded says nothing about the node's
        # hardware. A job with a run URI stops at from_env (or, with
        # checkpoint.agent_unreachable: local-only, keeps its checkpoints here).
        _agent_unreachable(ctx, "prolog", str(exc))
    return []


# metrics.events.CKPT_AGENT, named here: checkpoint sits below metrics.
CKPT_AGENT_UNREACHABLE = "ckpt_agent_unreachable"


def _agent_unreachable(ctx: HookContext, hook: str, error: str) -> None:
    """The operator's event and count: this node's agent did not answer a hook."""
    log.error("checkpoint: couldn't reach the node agent; the job's checkpoints on this node "
              "get no stage-in and are not uploaded to S3", hook=hook, error=error,
              job_id=ctx.job_id, node=ctx.node, waited_limit_s=ctx.cfg.agent.request_timeout_s)
    ctx.count_event(CKPT_AGENT_UNREACHABLE, hook)


def epilog(ctx: HookContext) -> list[Problem]:
    """Wait (bounded) for pending uploads, hand the rest to the agent, clean safely."""
    ck = ctx.cfg.checkpoint
    if not ck.enabled or ctx.job_id is None:
        return []
    root = node_path(ck.staging_root, ctx.node)
    sock = node_path(ctx.cfg.agent.socket, ctx.node)
    wait = ctx.cfg.agent.request_timeout_s
    try:
        answer = call(sock, "ckpt.job_end", timeout=wait, job_id=ctx.job_id)
    except AgentRefused as exc:
        log.warning("epilog: the agent refused job_end; keeping the staging dir",
                    error=str(exc))
        _clean(root, ctx.job_id)
        return []
    except AgentUnavailable as exc:
        _agent_unreachable(ctx, "epilog", f"{exc}; keeping the staging dir")
        _clean(root, ctx.job_id)
        return []
    pending = list_field(answer, "pending")
    deadline = time.monotonic() + ck.epilog_wait_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            pending = list_field(call(sock, "ckpt.status", timeout=wait, job_id=ctx.job_id),
                                 "pending")
        except AgentRefused:
            pending = []  # the agent already finished and forgot the job
        except AgentUnavailable as exc:
            log.warning("epilog: agent went away while waiting", error=str(exc))
            break
    _clean(root, ctx.job_id)
    if pending:
        log.warning("epilog: uploads still pending; the agent finishes them after the job",
                    pending_steps=pending, waited_s=ck.epilog_wait_s)
    elif answer.get("uri") or not _has_steps(root, ctx.job_id):
        # Everything is safe in S3, or nothing was saved.
        remove_or_hand_off(root, ctx.job_id, sock, budget_s=epilog_remove_s(ctx.cfg),
                           timeout=wait)
    return []


def remove_or_hand_off(root: str, job_id: int, sock: str, *, budget_s: float, timeout: float,
                       clock: Clock = SystemClock()) -> None:
    """Remove the job's staging dir within ``budget_s``; what doesn't fit (a job that left
    millions of files) is set aside under ``.stale/`` and the agent is asked to remove it in
    its own time, so the epilog never runs into its limit on a big tree."""
    try:
        remove_job_dir(root, job_id, RemovalBudget(max_seconds=budget_s, clock=clock))
        return
    except RemovalIncomplete as exc:
        left = str(exc)
    except (CheckpointError, OSError) as exc:
        log.warning("epilog: couldn't remove staging dir", error=str(exc))
        return
    try:
        set_aside_job_dir(root, job_id, f"not removed within the epilog's {budget_s:g}s")
    except (CheckpointError, OSError) as exc:
        log.error("epilog: staging dir only partly removed and couldn't be set aside; the "
                  "agent removes it once the job is forgotten", error=str(exc), removal=left)
        return
    try:
        call(sock, "ckpt.cleanup", timeout=timeout)
    except (AgentUnavailable, AgentRefused) as exc:
        log.warning("epilog: staging dir too big to remove within the epilog's budget; set "
                    "aside under .stale/, removed by the agent when it next cleans up",
                    budget_s=budget_s, removal=left, agent_error=str(exc))
        return
    log.warning("epilog: staging dir too big to remove within the epilog's budget; set aside "
                "and handed to the agent", budget_s=budget_s, removal=left)


def _has_steps(root: str, job_id: int) -> bool:
    """Whether a local-only job left committed steps (kept: they are the only copy)."""
    from slurm_resilience.checkpoint.staging import open_job_dir
    from slurm_resilience.uploader.rootfs import committed_steps_at

    try:
        with open_job_dir(root, job_id) as jfd:
            return bool(committed_steps_at(jfd))
    except FileNotFoundError:
        return False
    except (CheckpointError, OSError):
        return True  # could not check: keep it


def _clean(root: str, job_id: int) -> None:
    try:
        removed = clean_tmp(root, job_id)
    except FileNotFoundError:
        return
    except (CheckpointError, OSError) as exc:
        log.warning("epilog: couldn't clean staging dir", error=str(exc))
        return
    if removed:
        log.info("epilog: removed crashed saves and links", removed=removed)
