"""Nodes a relaunch took out of the step, waiting to be spares again (pure).

An incident takes a node out of the step: drained on evidence, drained as a suspect, or
lost. The job still holds it, and it may come back while the job runs: an operator repairs
and resumes it, its suspect verification returns it, a lost node's slurmd starts again and
Slurm keeps it in the job. The launcher then has it as a spare again, after the spares it
has, so the allocation does not run out of spares one incident at a time.

A node comes back only when Slurm has shown it out of service (drained, down or not
responding) since it left the step, and shows it in service now, still in the job:

* a node the job only avoids (a suspect the budget or the site keeps in service) was never
  out of service: it stays out of the step for the rest of the job, as a requeued job's
  excluded nodes do;
* a node lost moments ago, before Slurm noticed, is not in service in that sense: it
  waits until Slurm has marked it and it has been brought back.

The agent checks a spare against Slurm again before any relaunch uses it (hang/relaunch.py,
hang/nodeloss.py).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class Seen(enum.Enum):
    """What Slurm shows of a waiting node now."""

    OUT = "out of service"  # drained, down, not responding or failing
    IN_SERVICE = "in service"
    LEFT_JOB = "no longer in the job's allocation"


def seen(drained: bool, down: bool, state: str, in_job: bool) -> Seen:
    """Slurm's view of a node as :class:`Seen` (``down`` includes not responding)."""
    if not in_job:
        return Seen.LEFT_JOB
    if drained or down or "FAIL" in state.upper():
        return Seen.OUT
    return Seen.IN_SERVICE


@dataclass
class Returning:
    """The waiting nodes, each with whether Slurm has shown it out of service yet."""

    waiting: dict[str, bool] = field(default_factory=dict)

    def add(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            self.waiting.setdefault(n, False)

    def update(self, shown: Mapping[str, Seen]) -> tuple[list[str], list[str]]:
        """Take in what Slurm shows; (nodes back in service, nodes that left the job), both
        no longer waiting. A node Slurm did not show keeps waiting as it was."""
        back: list[str] = []
        left: list[str] = []
        for node, was_out in list(self.waiting.items()):
            now = shown.get(node)
            if now is Seen.LEFT_JOB:
                left.append(node)
            elif now is Seen.OUT:
                self.waiting[node] = True
            elif now is Seen.IN_SERVICE and was_out:
                back.append(node)
        for node in back + left:
            del self.waiting[node]
        return back, left
