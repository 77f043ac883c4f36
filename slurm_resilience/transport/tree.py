"""The fan-in tree of one job run: pure functions of (batch host, nodes, fan-out).

The batch host is the root; the other nodes, sorted by name, fill a complete k-ary tree in
breadth-first order, so every agent computes the same tree from the job's node list alone.
Each agent receives from at most k children, whatever the job's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Tree:
    """Positions of a run's nodes in its fan-in tree."""

    order: tuple[str, ...]
    fanout: int

    @classmethod
    def of(cls, batch_host: str, nodes: Sequence[str], fanout: int) -> Tree:
        if fanout < 1:
            raise ValueError(f"fan-out {fanout} must be at least 1")
        rest = sorted(set(nodes) - {batch_host})
        return cls((batch_host, *rest), fanout)

    @property
    def root(self) -> str:
        return self.order[0]

    @cached_property
    def _pos(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.order)}

    def __contains__(self, node: object) -> bool:
        return node in self._pos

    def index(self, node: str) -> int:
        return self._pos[node]

    def parent(self, node: str) -> str | None:
        """The node ``node`` sends to; None for the root."""
        i = self.index(node)
        return None if i == 0 else self.order[(i - 1) // self.fanout]

    def children(self, node: str) -> tuple[str, ...]:
        i = self.index(node)
        first = i * self.fanout + 1
        return self.order[first:first + self.fanout]

    def subtree(self, node: str) -> frozenset[str]:
        """``node`` and everything below it: the pieces it may forward."""
        out: set[str] = set()
        todo = [node]
        while todo:
            n = todo.pop()
            out.add(n)
            todo.extend(self.children(n))
        return frozenset(out)

    def depth(self, node: str) -> int:
        d, i = 0, self.index(node)
        while i:
            i = (i - 1) // self.fanout
            d += 1
        return d
