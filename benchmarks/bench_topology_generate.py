"""Topology generation time for a synthetic 16,384-node fabric (512 leaves, 32 spines).

Goal (issue 5): under 2 s for parse + model + checks + writing all outputs.
Reference in the same run: splitting the same capture into lines and matching
one regular expression per line (the least any parser must do). Run::

    .venv/bin/python benchmarks/bench_topology_generate.py [--leaves 512] [--spines 32]
        [--hosts-per-leaf 32] [--rails 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time

from timing import summarise

from slurm_resilience.config.topology import TopologySection
from slurm_resilience.topology import generate, ibnetdiscover, model, synthetic, validate


def generate_all(text: str, out_dir: str) -> tuple[model.Fabric, dict[str, float]]:
    """The whole `topology generate` path on ``text``; seconds per phase."""
    cfg = TopologySection()
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    disc = ibnetdiscover.parse(text)
    t1 = time.perf_counter()
    fabric = model.from_discovery(disc, cfg, source="synthetic")
    t2 = time.perf_counter()
    findings = validate.check_fabric(fabric)
    assert not any(f.error for f in findings), findings
    t3 = time.perf_counter()
    generate.write_outputs(generate.render(fabric, cfg), out_dir)
    t4 = time.perf_counter()
    phases.update(parse=t1 - t0, model=t2 - t1, check=t3 - t2, write=t4 - t3, total=t4 - t0)
    return fabric, phases


def reference(text: str) -> None:
    pattern = re.compile(r"^\[(\d+)\]")
    for line in text.splitlines():
        pattern.match(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=512)
    parser.add_argument("--spines", type=int, default=32)
    parser.add_argument("--hosts-per-leaf", type=int, default=32)
    parser.add_argument("--rails", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    text = synthetic.fat_tree(args.leaves, args.spines, args.hosts_per_leaf, rails=args.rails)
    print(f"capture: {len(text) / 1e6:.1f} MB, {text.count(chr(10))} lines")
    totals, refs = [], []
    last: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeat):
            fabric, last = generate_all(text, out)
            totals.append(last["total"])
            start = time.perf_counter()
            reference(text)
            refs.append(time.perf_counter() - start)
    nodes = len(fabric.nodes)
    print(f"fabric: {nodes} nodes, {len(fabric.leaves)} leaves, {len(fabric.uppers)} upper "
          f"switches")
    print("last run phases: " + ", ".join(f"{k} {v:.3f}s" for k, v in last.items()))
    best, ref = min(totals), min(refs)
    print(f"generation: best {best:.3f} s, median {summarise(totals).p50:.3f} s "
          f"(goal < 2 s: {'met' if best < 2 else 'NOT met'})")
    print(f"reference (line split + one regex): {ref:.3f} s; ratio {best / ref:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
