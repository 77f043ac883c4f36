"""Pure: a launcher's step ended non-zero with no order; was one of its nodes lost, and
what then.

Evidence comes from Slurm (one ``scontrol show node`` of the step's nodes and spares) and
from the batch host's own probes (:mod:`nodereach`): a step node is out when Slurm shows it
DOWN, NOT_RESPONDING or FAIL, or drained by us (our reason prefix: e.g. the health gate
drained it for an Xid while the step ran), or when neither its slurmd nor its agent has
taken a TCP connection for ``heartbeat.node_unreachable_s``. A node that failed on its own
is never drained here. With a node out and enough usable spares (listed in
the job's allocation, not drained, down or failing, ``--max-restarts`` not spent) the step is
relaunched inside the allocation with a spare in the lost node's place; otherwise the job is
requeued away from the lost nodes (the node-fault requeue). Slurm marks a dead node only
after SlurmdTimeout, so with nothing out yet the answer is to wait, up to a bound derived
from it; past the bound the step failed on healthy nodes and the launcher ends with its
status (the job is left alone).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurm_resilience.hang.launches import Launch, Order
from slurm_resilience.hang.relaunch import gate_reason
from slurm_resilience.slurm.parse import NodeInfo

# Slurm's default SlurmdTimeout, when its configuration can't be read.
DEFAULT_SLURMD_TIMEOUT_S = 300.0


class Verdict(enum.Enum):
    WAIT = "wait"  # nothing out yet: ask again
    RELAUNCH = "relaunch"  # on the survivors plus spares
    REQUEUE = "requeue"  # a node is out but can't be replaced here
    EXIT = "exit"  # no node out within the bound: the step failed for its own reasons


@dataclass(frozen=True)
class NodeLoss:
    """What the batch host's agent answers a launcher whose step ended non-zero."""

    verdict: Verdict
    reason: str
    out: Mapping[str, str]  # lost step node -> what Slurm shows
    order: Order | None = None
    wait_s: float = 0.0  # WAIT: how much longer the agent waits for Slurm


def wait_bound(slurmd_timeout_s: float, margin_s: float) -> float:
    """How long after the step's end a lost node may still be unmarked: Slurm marks it
    DOWN once it missed SlurmdTimeout of pings; twice ``margin_s`` covers the ping rounds."""
    return slurmd_timeout_s + 2 * margin_s


def slurmd_timeout(config: Mapping[str, str]) -> float | None:
    """SlurmdTimeout from ``scontrol show config`` (``30 sec``), None when unreadable."""
    value = config.get("SlurmdTimeout", "").split()
    return float(value[0]) if value and value[0].isdigit() else None


def slurmd_port(config: Mapping[str, str]) -> int | None:
    """SlurmdPort from ``scontrol show config``, None when unreadable."""
    value = config.get("SlurmdPort", "").strip()
    return int(value) if value.isdigit() else None


def _shown(info: NodeInfo) -> str:
    return "+".join([info.state, *sorted(info.flags)])


def why_out(info: NodeInfo | None, ours: Callable[[str], bool]) -> str:
    """Why Slurm shows a step node out ('' when it does not)."""
    if info is None:
        return "Slurm no longer lists it"
    flags = {info.state.upper(), *(f.upper() for f in info.flags)}
    shown = _shown(info)
    if info.down or "FAIL" in flags or "FAILING" in flags:
        return shown.lower() + (f" ({info.reason})" if info.reason else "")
    if info.drained and ours(info.reason):
        return f"drained ({info.reason})"
    return ""


def decide(launch: Launch, infos: Mapping[str, NodeInfo], *, job_nodes: Sequence[str],
           ours: Callable[[str], bool], waited_s: float, bound_s: float,
           unreachable: Mapping[str, str] | None = None) -> NodeLoss:
    """The answer for ``launch``'s step that ended non-zero ``waited_s`` ago; ``infos``: its
    nodes and spares as Slurm shows them now (missing: unknown to Slurm); ``unreachable``:
    step nodes the probes found lost, with what they saw."""
    probed = unreachable or {}
    out = {n: why for n in launch.nodes
           if (why := why_out(infos.get(n), ours) or probed.get(n, ""))}
    # Drained by us but up: its tasks end when told. Down or unreachable: they never report.
    gone = tuple(n for n, why in out.items() if not why.startswith("drained ("))
    job = launch.job_id
    if not out:
        if waited_s < bound_s:
            return NodeLoss(Verdict.WAIT, f"job {job}: no step node is out yet", {},
                            wait_s=bound_s - waited_s)
        seen = ", ".join(f"{n} {_shown(infos[n]).lower()}" for n in launch.nodes)
        return NodeLoss(Verdict.EXIT, f"job {job}: the step failed and Slurm shows every "
                                      f"node of it in service after {bound_s:g}s ({seen}): "
                                      "left alone", {})
    lost = ", ".join(f"{n} {why}" for n, why in out.items())
    if launch.relaunch >= launch.max_restarts:
        return NodeLoss(Verdict.REQUEUE, f"node fault in job {job} ({lost}); the launcher's "
                                         f"--max-restarts {launch.max_restarts} is spent", out)
    allocated = set(job_nodes)
    skipped: dict[str, str] = {}
    usable: list[str] = []
    for spare in launch.spares:
        info = infos.get(spare)
        why = ("not in the job's allocation" if spare not in allocated
               else "Slurm no longer lists it" if info is None
               else gate_reason(info.drained, info.down, info.state, info.reason))
        if why:
            skipped[spare] = why
        else:
            usable.append(spare)
    notes = "".join(f"; spare {s} not used: {w}" for s, w in sorted(skipped.items()))
    if len(usable) < len(out):
        return NodeLoss(Verdict.REQUEUE, f"node fault in job {job} ({lost}); no usable spare "
                                         f"for {','.join(out)}{notes}", out)
    spares = iter(usable)
    replaced = {n: next(spares) for n in out}
    nodes = tuple(replaced.get(n, n) for n in launch.nodes)
    gen = launch.relaunch + 1
    reason = (f"node fault in job {job} ({lost}): relaunch {gen} of {launch.max_restarts} "
              f"inside the allocation on {','.join(nodes)} "
              f"({', '.join(f'{s} for {n}' for n, s in replaced.items())}){notes}")
    order = Order(gen, nodes, tuple(replaced.values()), tuple(out), reason, gone)
    return NodeLoss(Verdict.RELAUNCH, reason, out, order)


def answer(loss: NodeLoss) -> dict[str, object]:
    """The socket answer (``launch.step_ended``)."""
    return {"verdict": loss.verdict.value, "reason": loss.reason, "out": dict(loss.out),
            "order": loss.order.to_json() if loss.order is not None else None,
            "wait_s": round(loss.wait_s, 3)}
