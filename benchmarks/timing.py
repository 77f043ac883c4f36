"""Shared helpers for the benchmarks: repeat, summarise, print ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Seconds per run: median, 99th percentile, mean, count."""

    p50: float
    p99: float
    mean: float
    n: int

    def ms(self) -> str:
        return f"p50 {self.p50 * 1e3:.1f} ms  p99 {self.p99 * 1e3:.1f} ms  (n={self.n})"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; enough for latency reporting."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def summarise(samples: list[float]) -> Summary:
    return Summary(statistics.median(samples), percentile(samples, 99),
                   statistics.fmean(samples), len(samples))


def repeat(fn: Callable[[], object], n: int, warmup: int = 2) -> Summary:
    """Run ``fn`` ``warmup`` times unmeasured, then ``n`` times measured."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return summarise(samples)


def ratio_line(name: str, ours: float, reference: float, goal: str) -> str:
    """One result line: the ratio and the goal it is judged against."""
    return f"{name}: {ours / reference:.3f}x of reference (goal {goal})"


def series(measure: Callable[[], float], runs: int, warmup: int = 2) -> Summary:
    """Call ``measure`` (which returns its own seconds, e.g. a timed subprocess)
    ``warmup`` times unmeasured, then ``runs`` times."""
    for _ in range(warmup):
        measure()
    return summarise([measure() for _ in range(runs)])
