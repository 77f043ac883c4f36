"""Synthetic step-time series for straggler tests and the false-positive benchmark.

Each member's step time is the job's base time with log-normal jitter, a shared slow step
every ``ckpt_every`` steps (a checkpoint save: every member pays it) and rare one-member
spikes (a GC pause, a page-cache miss). A slowed member pays ``slowdown`` on every step
from ``slow_from`` on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class JitterModel:
    base_s: float = 1.0
    jitter: float = 0.05  # sigma of the log-normal noise (5%)
    ckpt_every: int = 50
    ckpt_extra: float = 0.5  # a checkpoint step is 50% longer
    spike_p: float = 0.01  # per member and step
    spike_extra: float = 1.0  # a spike doubles that step


def steps(members: int, count: int, seed: int, model: JitterModel | None = None, *,
          slow_member: int | None = None, slowdown: float = 0.0, slow_from: int = 0
          ) -> Iterator[list[float]]:
    """``count`` steps; each yields one step time per member."""
    model = model or JitterModel()
    rng = random.Random(seed)  # noqa: S311 - a reproducible simulation, not a secret
    for step in range(count):
        shared = 1 + (model.ckpt_extra if model.ckpt_every and step % model.ckpt_every == 0
                      else 0.0)
        row = []
        for m in range(members):
            t = model.base_s * shared * math.exp(rng.gauss(0.0, model.jitter))
            if rng.random() < model.spike_p:
                t *= 1 + model.spike_extra
            if m == slow_member and step >= slow_from:
                t *= 1 + slowdown
            row.append(t)
        yield row
