"""Which node keeps a buddy copy of which node's checkpoint part: a ring over the job's nodes.

The ring is the job's node list (every node Slurm lists for it, spares included), sorted
by name, each node sending to the next and the last to the first. Sorting makes every
agent compute the same ring from the same list without talking to the others; spares are
in it because their NVMe is idle, and under ``slurm-resilience launch`` the spare that
follows a step node in the sorted list already holds that node's part when it replaces it.
A node's copy therefore lives on exactly one other node, so a job loses a step's part only
when a node and its buddy both die before the step reached S3.
"""

from __future__ import annotations

from collections.abc import Sequence


def ring(nodes: Sequence[str]) -> tuple[str, ...]:
    """The job's nodes in ring order (sorted, duplicates dropped)."""
    return tuple(sorted(set(nodes)))


def buddy_of(node: str, nodes: Sequence[str]) -> str | None:
    """The node that keeps ``node``'s buddy copy; None for a job of one node, or when
    ``node`` is not one of ``nodes``."""
    order = ring(nodes)
    if node not in order or len(order) < 2:
        return None
    return order[(order.index(node) + 1) % len(order)]


def held_for(node: str, nodes: Sequence[str]) -> str | None:
    """The node whose copy ``node`` keeps (its predecessor in the ring); None as above."""
    order = ring(nodes)
    if node not in order or len(order) < 2:
        return None
    return order[order.index(node) - 1]
