"""The job's link to its nodes' agents, made once at ``from_env``.

The lowest rank on each node registers the run URI with its agent (one request per node,
bounded by ``agent.request_timeout_s``: a missing socket fails at once, a stopped agent
after that limit); the ranks then share what each node found, so every rank takes the
same decision and names the same nodes. An agent that can't be reached means that
node's checkpoints never reach S3: by default (``checkpoint.agent_unreachable: error``)
every rank raises; with ``local-only`` every rank warns, and the reachable agents are
told which nodes are missing (``ckpt status``, a metric, a log event on those nodes).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from slurm_resilience.checkpoint.commit import CheckpointError

POLICY_KEY = "checkpoint.agent_unreachable"
MAX_NODE_NAMES = 64  # in one ckpt.register's unreachable_nodes


@dataclass(frozen=True)
class NodeReach:
    """What one rank found about its node's agent: ``refused`` or ``unreachable`` hold
    the agent's or the transport's error ("" when the agent took the registration, or
    when this rank did not register: another rank of its node did)."""

    node: str
    registered: bool
    refused: str = ""
    unreachable: str = ""


@dataclass(frozen=True)
class Registration:
    socket: str
    job_id: int
    uri: str
    allow_older_step: bool
    timeout_s: float


def register(reg: Registration, unreachable_nodes: tuple[str, ...] = ()) -> tuple[str, str]:
    """One ``ckpt.register``; (refused, unreachable): the error of whichever happened."""
    from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

    try:
        call(reg.socket, "ckpt.register", job_id=reg.job_id, uri=reg.uri,
             timeout=reg.timeout_s, allow_older_step=reg.allow_older_step,
             unreachable_nodes=list(unreachable_nodes))
    except AgentRefused as exc:
        return str(exc), ""
    except AgentUnavailable as exc:
        return "", f"{exc} (no answer within {reg.timeout_s:g}s: agent.request_timeout_s)" \
            if "timed out" in str(exc) else str(exc)
    return "", ""


def _gather(group: Any, mine: Any) -> list[Any]:
    if group is None:
        return [mine]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def connect(reg: Registration, *, node: str, rank: int, group: Any, policy: str) -> str:
    """Register (the lowest rank of each node), share the outcome, decide; on every rank
    alike.

    Returns "" when this node's agent took the registration, else why it can't be
    reached (policy local-only: this node's checkpoints stay here). Raises a
    CheckpointError on every rank when an agent refused the URI, or one can't be
    reached and the policy is ``error``.
    """
    # Who registers: by node name, not LOCAL_RANK, so every node is registered exactly once.
    ranks = _gather(group, (node, rank))
    first = min(r for n, r in ranks if n == node)
    registers = first == rank
    refused, unreachable = register(reg) if registers else ("", "")
    found = [r for r in _gather(group, NodeReach(node, registers, refused, unreachable))
             if isinstance(r, NodeReach)]
    refusals = [r for r in found if r.refused]
    if refusals:
        raise CheckpointError(refusals[0].refused if refusals[0].node == node else
                              f"checkpoint: register: the agent on {refusals[0].node} refused "
                              f"the run: {refusals[0].refused}")
    lost = {r.node: r.unreachable for r in found if r.registered and r.unreachable}
    if not lost:
        return ""
    names = ", ".join(sorted(lost))
    cause = lost[sorted(lost)[0]]
    if policy == "error":
        raise CheckpointError(
            f"checkpoint: register: couldn't reach the node agent on {names} ({cause}): "
            f"checkpoints saved there would never reach {reg.uri}, and nothing is staged in "
            f"there; stopping ({POLICY_KEY} is error). Start the agent on that node "
            f"(systemctl start slurm-resilience-agent), leave the node out (sbatch "
            f"--exclude={names.replace(', ', ',')}), or ask the site for {POLICY_KEY}: "
            "local-only")
    print(f"checkpoint: register: WARNING: couldn't reach the node agent on {names} "
          f"({cause}); checkpoints saved there stay on that node and never reach {reg.uri}, "
          f"so no step of this run commits in S3 until it returns ({POLICY_KEY} is "
          "local-only)", file=sys.stderr, flush=True)
    if registers and node not in lost:
        # Tell this node's agent, so its status, metrics and log name the missing nodes.
        refused, unreachable = register(reg, tuple(sorted(lost)))
        if refused or unreachable:
            print(f"checkpoint: register: couldn't tell this node's agent about {names}: "
                  f"{refused or unreachable}", file=sys.stderr, flush=True)
    return lost.get(node, "")
