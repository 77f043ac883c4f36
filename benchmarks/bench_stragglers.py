"""Straggler naming on synthetic step times: false positives on normal jitter, and how many
steps a slowed node takes to be named.

Normal jobs: 8 nodes, 300 steps, 5% log-normal jitter, a checkpoint step (+50%) every 50
steps and 1% one-node spikes (2x), over many seeds; a job counts as a false positive when
any node is named at any step. Slowed jobs: the same with one node 15% (and 30%) slower
from step 0. Thresholds are the config defaults (slurm_resilience.config.metrics).

    .venv/bin/python benchmarks/bench_stragglers.py [--seeds N]
"""

from __future__ import annotations

import argparse
import statistics

from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.stragglers.detect import Tracker
from slurm_resilience.stragglers.synthetic import JitterModel, steps


def run_job(cfg: StragglerSection, seed: int, nodes: int, count: int, model: JitterModel,
            slow: int | None, slowdown: float) -> tuple[set[int], int | None]:
    """Nodes ever named, and the step at which the slowed node was first named."""
    tracker: Tracker[int] = Tracker(cfg)
    ever: set[int] = set()
    first: int | None = None
    for i, row in enumerate(steps(nodes, count, seed, model, slow_member=slow,
                                  slowdown=slowdown)):
        for node, t in enumerate(row):
            tracker.add(node, t)
        tracker.evaluate()
        named = tracker.named
        ever |= named
        if slow is not None and first is None and slow in named:
            first = i + 1
    return ever, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=500, help="jobs simulated per case")
    ap.add_argument("--steps", type=int, default=300, help="steps per job (>= 200)")
    ap.add_argument("--nodes", type=int, default=8, help="nodes per job")
    ap.add_argument("--jitter", type=float, default=0.05,
                    help="sigma of the log-normal step-time noise (0.05: 5%%)")
    args = ap.parse_args()
    cfg = StragglerSection()
    model = JitterModel(jitter=args.jitter)
    fp_jobs = sum(bool(run_job(cfg, s, args.nodes, args.steps, model, None, 0.0)[0])
                  for s in range(args.seeds))
    print(f"normal jobs: {args.seeds} x {args.steps} steps x {args.nodes} nodes; "
          f"jobs naming any straggler: {fp_jobs} ({fp_jobs / args.seeds:.2%})")
    for slowdown in (0.15, 0.30):
        firsts, wrong, missed = [], 0, 0
        for s in range(args.seeds):
            ever, first = run_job(cfg, 10_000 + s, args.nodes, args.steps, model, 3, slowdown)
            wrong += bool(ever - {3})
            if first is None:
                missed += 1
            else:
                firsts.append(first)
        q = statistics.quantiles(firsts, n=100) if len(firsts) > 1 else [0.0] * 99
        print(f"one node {slowdown:.0%} slower: named in {len(firsts)}/{args.seeds} jobs; "
              f"steps to name it: median {statistics.median(firsts) if firsts else 0:.0f}, "
              f"p99 {q[98]:.0f}, max {max(firsts, default=0)}; missed {missed}; "
              f"jobs also naming another node: {wrong}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
