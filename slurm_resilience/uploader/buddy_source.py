"""Where a restore takes each part of a step from: its own NVMe, S3, or a buddy's copy.

A pure decision over what the restoring node's agent gathered: the step parts committed on
its own NVMe, the verified buddy copies the job's agents hold (each a node's part of one
step), and the run's committed steps in S3 (empty, with the cause, when S3 can't be
reached). The step chosen is the newest step committed anywhere whose every rank can be
had; a newer step that can't (a node and its buddy both lost before the upload, S3 down)
is passed over with a reason that names the step and the ranks no reachable copy holds,
never quietly. For one step, a part on this node's NVMe is read there; otherwise S3 when
it holds the step (whole, and off the job's nodes); otherwise the buddy's copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from slurm_resilience.checkpoint.arrival import ranks_text


class Where(str, Enum):
    LOCAL = "local"  # this node's own staging NVMe
    BUDDY = "buddy"  # a verified buddy copy on another node (or this node's buddy area)
    S3 = "s3"


@dataclass(frozen=True)
class Copy:
    """One node's part of one step, held somewhere reachable (verified where it is held)."""

    step: int
    node: str  # the node that saved this part
    ranks: frozenset[int]
    world_size: int
    where: Where  # LOCAL or BUDDY
    holder: str  # the node whose NVMe holds it


@dataclass(frozen=True)
class PartSource:
    """Where the ranks ``ranks`` of the chosen step come from."""

    ranks: tuple[int, ...]
    where: Where
    holder: str  # the node holding it; "" for S3


@dataclass(frozen=True)
class Passed:
    """A newer committed step the choice passed over, and why (said by name)."""

    step: int
    reason: str


@dataclass(frozen=True)
class Choice:
    """The step to restore (None: nothing committed can be had) and each part's source."""

    step: int | None
    sources: tuple[PartSource, ...]
    passed_over: tuple[Passed, ...]

    def summary(self) -> str:
        """``step 30: ranks 0, 1 local on n1; ranks 2, 3 buddy on n3`` for status and logs."""
        if self.step is None:
            return "no step"
        parts = "; ".join(f"{ranks_text(s.ranks)} {s.where.value}"
                          + (f" on {s.holder}" if s.holder else "") for s in self.sources)
        return f"step {self.step}: {parts}"


def choose(copies: Iterable[Copy], s3_steps: Iterable[int], s3_error: str = "") -> Choice:
    """The newest step every rank of which can be had, and where each part comes from."""
    held = list(copies)
    in_s3 = set(s3_steps)
    steps = sorted({c.step for c in held} | in_s3, reverse=True)
    passed: list[Passed] = []
    for step in steps:
        mine = [c for c in held if c.step == step]
        local = [c for c in mine if c.where is Where.LOCAL]
        buddy = [c for c in mine if c.where is Where.BUDDY]
        sources: list[PartSource] = []
        covered: set[int] = set()
        for c in sorted(local, key=lambda c: min(c.ranks, default=0)):
            take = sorted(c.ranks - covered)
            if take:
                sources.append(PartSource(tuple(take), Where.LOCAL, c.holder))
                covered.update(take)
        if step in in_s3:
            world = max((c.world_size for c in mine), default=0)
            rest = tuple(sorted(set(range(world)) - covered)) if world else ()
            if rest or not world:
                sources.append(PartSource(rest, Where.S3, ""))
            return Choice(step, tuple(sources), tuple(passed))
        worlds = {c.world_size for c in mine}
        if len(worlds) != 1:
            passed.append(Passed(step, f"step {step}: its parts disagree on the world size "
                                       f"({sorted(worlds)})"))
            continue
        (world,) = worlds
        for c in sorted(buddy, key=lambda c: (min(c.ranks, default=0), c.holder)):
            take = sorted(c.ranks - covered)
            if take:
                sources.append(PartSource(tuple(take), Where.BUDDY, c.holder))
                covered.update(take)
        missing = sorted(set(range(world)) - covered)
        if missing:
            why = f"S3 can't be reached: {s3_error}" if s3_error else "S3 does not have it"
            passed.append(Passed(step, f"step {step}: {ranks_text(tuple(missing))} of "
                                       f"0..{world - 1} are in no reachable copy (not on this "
                                       f"node, in no buddy copy, and {why})"))
            continue
        return Choice(step, tuple(sources), tuple(passed))
    return Choice(None, (), tuple(passed))
