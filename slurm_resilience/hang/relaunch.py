"""Pure: turn a hang's requeue into a relaunch inside the allocation when the job runs under
``slurm-resilience launch`` with a usable spare.

The nodes the decision takes out (drained on evidence, suspects, and nodes the requeued job
would have avoided) leave the step; each is replaced by one of the launcher's spares that
Slurm lists in the job's allocation and that passes the gate (not drained, down or failing
in Slurm now: the prolog's gate and the idle checks drain a spare that fails them). A hang
nobody can be blamed for relaunches on the same nodes. The job is requeued as before when
the launcher's ``--max-restarts`` is spent or there are fewer usable spares than nodes to
replace. The ledger keeps its requeue count (a relaunch is not a requeue) and records the
attempt, so the same run is never handled twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

from slurm_resilience.hang import requeue as R
from slurm_resilience.hang.actions import Step, StepKind
from slurm_resilience.hang.incidentrecords import Action, Decision, NodeVerdict
from slurm_resilience.hang.launches import Launch, Order
from slurm_resilience.heartbeat.attempt import relaunch_of


def taken_out(decision: Decision) -> set[str]:
    """The nodes the decision takes out of the job: drained, suspects, avoided."""
    out = {c.node for c in decision.nodes
           if c.verdict in (NodeVerdict.DRAIN, NodeVerdict.SUSPECT)}
    return out | set(decision.exclude)


def choose(decision: Decision, launch: Launch, *, job_nodes: Sequence[str],
           unusable: Mapping[str, str], run: int, admin_comment: str
           ) -> tuple[Decision, Order | None]:
    """The decision to carry out and the launcher's order (None: requeue as decided).
    ``unusable``: spares that fail the gate now, with why; ``run``: the incident's attempt."""
    if decision.action is not Action.REQUEUE:
        return decision, None
    if launch.relaunch >= launch.max_restarts:
        return replace(decision, reason=f"{decision.reason}; the launcher's --max-restarts "
                                        f"{launch.max_restarts} is spent"), None
    bad = taken_out(decision)
    out = [n for n in launch.nodes if n in bad]
    allocated = set(job_nodes)
    skipped = {s: why for s, why in unusable.items() if s in launch.spares}
    usable = [s for s in launch.spares
              if s in allocated and s not in bad and s not in skipped]
    if len(usable) < len(out):
        why = "; ".join(f"spare {s} not used: {w}" for s, w in sorted(skipped.items()))
        return replace(decision, reason=f"{decision.reason}; no usable spare for "
                                        f"{','.join(out)}" + (f" ({why})" if why else "")), None
    spares = iter(usable)
    replaced = {n: next(spares) for n in out}
    nodes = tuple(replaced.get(n, n) for n in launch.nodes)
    gen = launch.relaunch + 1
    what = (f" on {','.join(nodes)} ({', '.join(f'{s} for {n}' for n, s in replaced.items())})"
            if replaced else f" on the same nodes {','.join(nodes)}")
    reason = (f"hang job {launch.job_id}: relaunch {gen} of {launch.max_restarts} inside the "
              f"allocation{what}")
    if skipped:
        reason += "; " + "; ".join(f"spare {s} not used: {w}" for s, w in sorted(skipped.items()))
    previous = R.parse_ledger(admin_comment) or R.Ledger()
    ledger = R.Ledger(previous.requeues, decision.ckpt_step, run)
    order = Order(gen, nodes, tuple(replaced.values()), tuple(out), reason)
    return replace(decision, action=Action.RELAUNCH, reason=reason, ledger=ledger.token(),
                   exclude=()), order


def gate_reason(drained: bool, down: bool, state: str, reason: str) -> str:
    """Why a spare fails the gate as Slurm shows it ('' when it passes)."""
    if drained or down or "FAIL" in state.upper():
        return f"{state.lower()}" + (f" ({reason})" if reason else "")
    return ""


def order_step(order: Order) -> Step:
    return Step(StepKind.RELAUNCH, str(order.relaunch),
                json.dumps({"joined": list(order.joined), "out": list(order.out),
                            "reason": order.reason}), order.nodes)


def order_of(step: Step) -> Order:
    """The order a persisted RELAUNCH step carries (raises ValueError when malformed)."""
    data = json.loads(step.text)
    return Order(int(step.target), tuple(step.nodes), tuple(str(n) for n in data["joined"]),
                 tuple(str(n) for n in data["out"]), str(data["reason"]))


def stale(run: int, launch: Launch | None) -> bool:
    """An incident of an earlier relaunch than the launcher's current one."""
    return launch is not None and relaunch_of(run) < launch.relaunch
