"""Pure straggler judgement over windows of step times.

A member (a rank, or a node) is *slow* at one judgement when the median of its window is
both ``min_slowdown`` above the job's reference (the median of the members' medians) and
``mad_threshold`` robust standard deviations above it (1.4826 x the MAD of the members'
medians, floored at 1% of the reference so that near-identical members don't make any
small difference look huge). It is *named* once it was slow in ``persist_evaluations``
consecutive judgements. Medians, not means: one checkpoint step or one GC pause in a window
moves neither.

With fewer than three judged members nobody is named: with two, the data can't say which
one is the slow one.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from slurm_resilience.config.metrics import StragglerSection

M = TypeVar("M", bound=Hashable)

MAD_SCALE = 1.4826  # MAD of a normal distribution times this is its standard deviation
SPREAD_FLOOR = 0.01  # of the reference: the least spread a judgement assumes
MIN_MEMBERS = 3


@dataclass(frozen=True)
class Judgement(Generic[M]):
    """One judgement of a job's members."""

    reference_s: float  # the job's median step time (median of the members' medians)
    spread_s: float  # robust standard deviation of the members' medians
    medians: Mapping[M, float]
    slow: frozenset[M]


def judge(windows: Mapping[M, Sequence[float]], cfg: StragglerSection) -> Judgement[M]:
    """Which members are slow now (no persistence here: see :class:`Tracker`)."""
    return judge_medians({m: statistics.median(w) for m, w in windows.items()
                          if len(w) >= cfg.min_steps}, cfg)


@dataclass(frozen=True)
class Summary:
    """A member's median step time taken elsewhere, over a window of ``steps`` steps: what a
    node's agent sends its job's judging agent (:mod:`.nodes`)."""

    median_s: float
    steps: int


def judge_summaries(summaries: Mapping[M, Summary], cfg: StragglerSection) -> Judgement[M]:
    """:func:`judge` over medians taken elsewhere: members with fewer than ``min_steps``
    steps in their window (or no step time) are not judged."""
    return judge_medians({m: s.median_s for m, s in summaries.items()
                          if s.steps >= cfg.min_steps and s.median_s > 0}, cfg)


def advance(streak: Mapping[M, int], slow: frozenset[M]) -> dict[M, int]:
    """The run of consecutive slow judgements after one more judgement: a member not slow
    now starts again from zero."""
    return {m: streak.get(m, 0) + 1 for m in slow}


def persisted(streak: Mapping[M, int], cfg: StragglerSection) -> frozenset[M]:
    """Members slow in at least ``persist_evaluations`` consecutive judgements: named."""
    return frozenset(m for m, n in streak.items() if n >= cfg.persist_evaluations)


def judge_medians(medians: Mapping[M, float], cfg: StragglerSection) -> Judgement[M]:
    """The same judgement over members' medians taken elsewhere (each over a window of at
    least ``min_steps``)."""
    if len(medians) < MIN_MEMBERS:
        return Judgement(0.0, 0.0, medians, frozenset())
    ref = statistics.median(medians.values())
    mad = statistics.median(abs(v - ref) for v in medians.values())
    spread = max(MAD_SCALE * mad, SPREAD_FLOOR * ref)
    slow = frozenset(m for m, v in medians.items()
                     if v > ref * (1 + cfg.min_slowdown) and v - ref > cfg.mad_threshold * spread)
    return Judgement(ref, spread, medians, slow)


@dataclass
class Tracker(Generic[M]):
    """One job's windows and the run of consecutive slow judgements of each member."""

    cfg: StragglerSection
    windows: dict[M, deque[float]] = field(default_factory=dict)
    streak: dict[M, int] = field(default_factory=dict)
    last: Judgement[M] | None = None

    def add(self, member: M, step_time_s: float) -> None:
        if step_time_s <= 0:
            return
        window = self.windows.get(member)
        if window is None:
            window = self.windows[member] = deque(maxlen=self.cfg.window_steps)
        window.append(step_time_s)

    def forget(self, members: Iterable[M]) -> None:
        for m in members:
            self.windows.pop(m, None)
            self.streak.pop(m, None)

    def evaluate(self) -> Judgement[M]:
        """Judge now and advance every member's streak (call once per new step)."""
        j = judge(self.windows, self.cfg)
        self.streak = advance(self.streak, j.slow)
        self.last = j
        return j

    @property
    def named(self) -> frozenset[M]:
        """Members slow in at least ``persist_evaluations`` consecutive judgements."""
        return persisted(self.streak, self.cfg)
