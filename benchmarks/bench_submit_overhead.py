"""sbatch throughput with job_submit.lua (leaf pinning) against the same sandbox without it.

Goal (issue 5): with the plugin, at least 0.95x the submissions per second of
the plugin-less sandbox. Two sandboxes (6 nodes, 3 leaves) run side by side,
one with JobSubmitPlugins=lua and the generated data, one without; rounds
alternate between them so machine noise hits both. Jobs are 2-node and
submitted held (--hold), so only submission is measured, then cancelled. Run
as root::

    .venv/bin/python benchmarks/bench_submit_overhead.py [--jobs 100] [--rounds 4]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.layout import S3_OFFSET, Layout

REPO = Path(__file__).resolve().parents[1]


def _free(base: int, nodes: int) -> bool:
    for port in [base, *range(base + 1, base + nodes + 1), base + S3_OFFSET]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def start(name: str, base: int, overrides: dict[str, str]) -> Sandbox:
    while not _free(base, 6):
        base += 150
    state = Path(tempfile.mkdtemp(prefix=f"sr-bench-{name}-", dir="/tmp"))
    state.chmod(0o755)
    layout = Layout(state_dir=state, nodes=6, leaves=3, port_base=base, repo=REPO,
                    slurm_overrides=tuple(overrides.items()))
    return Sandbox.start(layout)


def round_rate(box: Sandbox, jobs: int) -> float:
    """Submissions per second of ``jobs`` sequential held 2-node sbatch calls."""
    start = time.perf_counter()
    for _ in range(jobs):
        box.sbatch(["true"], args=["-N2", "--hold", "--output=/dev/null"])
    rate = jobs / (time.perf_counter() - start)
    box.run(["scancel", "--state=PENDING", "--full"], check=False)
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--port-base", type=int, default=26000)
    args = parser.parse_args()
    with_lua = start("lua", args.port_base, {})
    without = start("plain", args.port_base + 300, {"JobSubmitPlugins": ""})
    try:
        log = (with_lua.layout.log_dir / "slurmctld.log").read_text(errors="replace")
        if "leaf-pin: loaded" not in log:
            print("the plugin did not load its data; see slurmctld.log", file=sys.stderr)
            return 1
        rates: dict[str, list[float]] = {"lua": [], "plain": []}
        round_rate(with_lua, 5)
        round_rate(without, 5)
        for i in range(args.rounds):
            order = [("lua", with_lua), ("plain", without)]
            for name, box in order if i % 2 == 0 else reversed(order):
                rates[name].append(round_rate(box, args.jobs))
        pinned = (with_lua.layout.log_dir / "slurmctld.log").read_text().count("switches=")
        lua, plain = max(rates["lua"]), max(rates["plain"])
        print(f"with job_submit.lua: {', '.join(f'{r:.1f}' for r in rates['lua'])} jobs/s "
              f"(best {lua:.1f}); {pinned} submissions pinned")
        print(f"without plugin:      {', '.join(f'{r:.1f}' for r in rates['plain'])} jobs/s "
              f"(best {plain:.1f})")
        ratio = lua / plain
        print(f"sbatch throughput ratio (best of rounds): {ratio:.3f}x "
              f"(goal >= 0.95x: {'met' if ratio >= 0.95 else 'NOT met'})")
        return 0
    finally:
        for box in (with_lua, without):
            box.stop()
            shutil.rmtree(box.state_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
