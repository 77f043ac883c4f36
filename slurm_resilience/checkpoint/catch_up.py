"""Ranks that disagree on the newest committed step (the job side): gather every rank's
view, take agree.py's decision, and bring the nodes lagging behind a step committed in
S3 up to it before any rank loads.

A lagging node's local leader asks its agent to stage exactly that step in
(``ckpt.stage``, stage_agreed.py); every rank there waits for it as ``load_latest``
waits for stage-in. Then every rank hears every node's outcome: all load the step, or
all raise naming the node and the cause. Never an older step when a newer one is whole.
A step that fails verification while loading is passed over the same way on every node
(``pass_over``: ``ckpt.restage``).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from slurm_resilience.checkpoint.agree import Agreement, RankView, agree
from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.checkpoint.stagein_status import StageinStatus
from slurm_resilience.heartbeat.attempt import ENV_JOINED
from slurm_resilience.log import get_logger

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.manager import CheckpointManager

log = get_logger("checkpoint.restore")

# At a relaunch, how many older steps the spares try when the newest can't be had.
MAX_OLDER = 2


def agree_ranks(mgr: CheckpointManager, candidate: int, status: StageinStatus,
                local: list[int]) -> int | None:
    """The step every rank loads (None: a fresh start the job allowed), or a
    CheckpointError naming why there is none. A collective: every rank calls it."""
    import torch.distributed as dist

    node = this_node()
    joined = node in os.environ.get(ENV_JOINED, "").split(",")
    mine = rank_view(mgr.rank, node, candidate, status, local, joined)
    views: list[Any] = [None] * mgr.world_size
    dist.all_gather_object(views, mine, group=mgr.group)
    result = agree(views)
    if result.step is None:
        mgr._fresh_or_raise(f"checkpoint: load: ranks disagree on the newest committed "
                            f"step: {result.error}")
        return None
    print(f"checkpoint: load: WARNING: {result.warning}", file=sys.stderr, flush=True)
    if result.fetch:
        # The agent takes the step from the job's nodes that hold it (their own or buddy
        # copies) before S3: a spare joined at a relaunch usually never touches S3.
        log.warning("ranks disagree on the newest committed step; the nodes that lack it "
                    "stage it in through their node agent", step=result.step,
                    nodes=list(result.fetch), rank=mgr.rank, detail=result.warning)
        step, failed = fetch_newest_or_older(mgr, result, functools.partial(_fetch, mgr, node))
        if failed:
            where = "on the nodes that kept running" if result.older else "in S3"
            mgr._fresh_or_raise(f"checkpoint: load: ranks disagree on the newest committed "
                                f"step: step {result.step} is committed {where} but "
                                f"couldn't be staged in on {failed}")
            return None
        return step
    for step in result.passed_over:  # a later save(step) sets it aside, never skips it
        mgr._passed_over[step] = f"not committed on every node; resumed from {result.step}"
    log.warning("ranks disagree on the newest committed step; resuming from an older one",
                step=result.step, newest=result.newest, rank=mgr.rank, detail=result.warning)
    return result.step


def this_node() -> str:
    """This rank's node: Slurm's name for it, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def rank_view(rank: int, node: str, candidate: int, status: StageinStatus,
              local: list[int], joined: bool) -> RankView:
    """This rank's view for agree(). The stage-in's source speaks for its own step only: a
    relaunch's candidate can be this run's own newer commit (choose_step.py), which S3 may
    not hold yet, and saying it came from S3 would send the lagging nodes to wait there."""
    from_s3 = status.source == "s3" and status.step == candidate
    return RankView(rank, node, candidate, from_s3, tuple(local), joined)


def fetch_newest_or_older(mgr: CheckpointManager, result: Agreement,
                          fetch: Callable[[Agreement], str]) -> tuple[int, str]:
    """The step the lagging nodes could fetch: ``result.step``, or at a relaunch the newest
    of ``result.older`` (said on rank 0's stderr and in the log; the newer steps are
    passed over); with what failed where when none could be had. A collective."""
    assert result.step is not None
    failed = fetch(result)
    for older in result.older[:MAX_OLDER] if failed else ():
        log.warning("relaunch: the newest step can't be had on the spares; fetching an "
                    "older one", step=result.step, older=older, nodes=list(result.fetch),
                    error=failed, rank=mgr.rank)
        again = fetch(replace(result, step=older, newest=older))
        if again:
            failed = f"{failed}; step {older}: {again}"
            continue
        if mgr.rank == 0:
            print(f"checkpoint: load: WARNING: step {result.step} can't be had on "
                  f"{', '.join(result.fetch)} ({failed}): its part on a lost node reached "
                  f"neither S3 nor its buddy. Resuming from OLDER step {older}, the newest "
                  "the other nodes committed", file=sys.stderr, flush=True)
        for step in (result.step, *(s for s in result.older if s > older)):
            # A later save() of these sets the stale local copies aside.
            mgr._passed_over[step] = (f"its part on a lost node was never saved elsewhere; "
                                      f"resumed from {older}")
        return older, ""
    return result.step, failed


def _fetch(mgr: CheckpointManager, node: str, result: Agreement) -> str:
    """Stage ``result.step`` in on the nodes in ``result.fetch``; what failed where
    (``node: cause; ...``, the same on every rank), or "" when every node has it."""
    import torch.distributed as dist

    step, error = int(result.newest), ""
    lagging = node in result.fetch
    if lagging and mgr.local_leader:
        error = _ask(mgr, step)
    mgr._all_max([0])  # a barrier: every lagging agent is staging before anyone asks
    if lagging and not error:
        try:
            status = mgr.wait_stagein()
        except CheckpointError as exc:  # its stage-in deadline: told to every rank below
            error = str(exc)
        else:
            if status.state != "done" or status.step != step:
                error = status.error or (f"its stage-in ended {status.state} with step "
                                         f"{status.step}, not {step}")
    outcomes: list[Any] = [None] * mgr.world_size
    dist.all_gather_object(outcomes, (node, error), group=mgr.group)
    return "; ".join(sorted({f"{n}: {e}" for n, e in outcomes if e}))


def _ask(mgr: CheckpointManager, step: int) -> str:
    """Have this node's agent stage ``step`` in (``ckpt.stage``); why it couldn't, or ""."""
    if mgr.agent_socket is None or mgr.job_id is None:
        return "no node agent to stage it in"
    from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

    try:
        call(mgr.agent_socket, "ckpt.stage", job_id=mgr.job_id, step=step, timeout=30.0)
    except (AgentRefused, AgentUnavailable) as exc:
        return f"couldn't ask the node agent: {exc}"
    return ""


def pass_over(mgr: CheckpointManager, step: int, why: str) -> None:
    """Only a failed verification falls back: say so loudly, and have every node's agent
    stage in the next older step (``ckpt.restage``) before any rank asks again."""
    mgr._trusted.discard(step)
    mgr._passed_over[step] = why
    if mgr.rank == 0:
        print(f"checkpoint: load: WARNING: committed step {step} does not verify; falling "
              f"back to an older step: {why}", file=sys.stderr, flush=True)
    if mgr.local_leader and mgr.agent_socket is not None and mgr.job_id is not None:
        from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

        try:
            call(mgr.agent_socket, "ckpt.restage", job_id=mgr.job_id, step=step,
                 reason=why[:500], timeout=30.0)
        except (AgentRefused, AgentUnavailable) as exc:
            # latest_step() then fails with the cause, on every rank.
            print(f"checkpoint: load: couldn't ask the node agent to stage an older step: "
                  f"{exc}", file=sys.stderr, flush=True)
    mgr._all_max([0])  # a barrier: every agent is restaging before anyone reads status
