"""Pure blame: which node caused a hang, or a clear "none can be blamed".

When one rank stalls, every other rank soon waits for it in a collective, so
"who stopped last" says nothing; we look for who stopped *first*:

1. a node with fresh health findings (an XID since the job started, a failed
   gate check) is blamed for them;
2. else ranks behind the others (a lower last step) stalled first;
3. else, among ranks at the same step, those whose stack is *not* waiting in a
   collective while others are;
4. else a rank whose last progress is clearly earlier than every other's.

The stalled-first ranks must all be on one node to blame it; otherwise the
report says why no node was drained.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Frames of a thread that waits for other ranks (torch.distributed, DDP's reducer, autograd).
_COLLECTIVE = re.compile(
    r"(torch/distributed/|torch/nn/parallel/|torch/autograd/|"
    r"\b(all_reduce|allreduce|all_gather|reduce_scatter|broadcast|barrier|all_to_all|"
    r"monitored_barrier)\b)"
)


@dataclass(frozen=True)
class RankObservation:
    """What is known about one stalled rank, from its node's agent."""

    rank: int
    node: str
    step: int
    last_progress: float  # Unix time
    in_collective: bool | None = None  # from its stack; None when no stack was captured
    step_time_s: float = 0.0


@dataclass(frozen=True)
class Blame:
    """The verdict: nodes to drain with their reasons, or none and why."""

    drains: tuple[tuple[str, str], ...]
    ranks: tuple[int, ...]
    rule: str
    explanation: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def node(self) -> str | None:
        return self.drains[0][0] if self.drains else None


def in_collective(stack_text: str) -> bool | None:
    """Whether a py-spy dump shows the main thread waiting in a collective."""
    if not stack_text.strip():
        return None
    main = _main_thread(stack_text)
    return bool(_COLLECTIVE.search(main))


def _main_thread(text: str) -> str:
    """The frames of the MainThread block of a py-spy dump (the whole text if absent)."""
    blocks = re.split(r"(?m)^(?=Thread )", text)
    for block in blocks:
        if block.startswith("Thread ") and '"MainThread"' in block.splitlines()[0]:
            return block
    return text


def _names(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _first_stalled(obs: Sequence[RankObservation]) -> tuple[list[RankObservation], str]:
    lowest = min(o.step for o in obs)
    behind = [o for o in obs if o.step == lowest]
    if len(behind) < len(obs):
        return behind, "lowest step"
    waiting = [o for o in obs if o.in_collective is True]
    working = [o for o in obs if o.in_collective is False]
    if waiting and working:
        return working, "not waiting in a collective"
    ordered = sorted(obs, key=lambda o: o.last_progress)
    if len(ordered) > 1:
        times = [o.step_time_s for o in obs if o.step_time_s > 0]
        margin = max(1.0, 2 * statistics.median(times)) if times else 1.0
        if ordered[1].last_progress - ordered[0].last_progress > margin:
            return [ordered[0]], f"last progress more than {margin:.1f}s before the others"
    return [], ""


def blame(job_id: int, obs: Sequence[RankObservation],
          findings: Mapping[str, Sequence[str]]) -> Blame:
    """Decide which node to drain for the hang of ``job_id``.

    ``obs`` holds the ranks seen on every node that reported; ``findings``
    maps a node to its fresh health findings (already short, human sentences).
    """
    fresh = {n: list(f) for n, f in findings.items() if f}
    if fresh:
        drains = tuple((node, f"hang job {job_id}: {items[0]}")
                       for node, items in sorted(fresh.items()))
        return Blame(drains, (), "health",
                     "fresh health findings: " + "; ".join(
                         f"{n}: {', '.join(f)}" for n, f in sorted(fresh.items())))
    if not obs:
        return Blame((), (), "none", "no rank observations: no node can be blamed")
    first, rule = _first_stalled(obs)
    if not first:
        return Blame((), (), "none",
                     f"all {len(obs)} ranks stalled at step {obs[0].step} at the same time "
                     "with the same kind of stack: no node can be blamed, none drained")
    ranks = sorted(o.rank for o in first)
    nodes = sorted({o.node for o in first})
    if len(nodes) > 1:
        return Blame((), tuple(ranks), rule,
                     f"{_names(ranks)} stalled first ({rule}) but they are on nodes "
                     f"{', '.join(nodes)}: no single node can be blamed, none drained")
    reason = f"hang job {job_id}: {_names(ranks)} stalled first"
    return Blame(((nodes[0], reason),), tuple(ranks), rule,
                 f"{_names(ranks)} on {nodes[0]} stalled first ({rule})")
