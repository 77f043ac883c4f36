"""Cost of ``heartbeat.beat(step)`` per call, against an empty function call in the same run.

Goal (issue 7): at most 2 µs per beat on the reference machine. Run::

    .venv/bin/python benchmarks/bench_heartbeat.py [--calls N] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

from slurm_resilience import heartbeat
from slurm_resilience.heartbeat import slot as S


def _empty(step: int) -> None:
    return None


def per_call_ns(fn: Callable[[int], None], calls: int, repeat: int) -> float:
    """Best-of-``repeat`` nanoseconds per call of ``fn(step)`` in a plain loop."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for step in range(calls):
            fn(step)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "job-1"), 0o700)
        hb = heartbeat.init({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                             "SLURM_RESILIENCE_RUN_DIR": tmp})
        assert hb is not None
        empty = per_call_ns(_empty, args.calls, args.repeat)
        method = per_call_ns(hb.beat, args.calls, args.repeat)
        module = per_call_ns(heartbeat.beat, args.calls, args.repeat)
        # The agent's side: one consistent read of a slot, against the bare pread it needs.
        fd = os.open(hb.path, os.O_RDONLY)
        raw = per_call_ns(lambda _: os.pread(fd, S.SIZE, 0), args.calls // 10, args.repeat)
        read = per_call_ns(lambda _: S.read_consistent(lambda: os.pread(fd, S.SIZE, 0)),
                           args.calls // 10, args.repeat)
        os.close(fd)
        hb.close()
    print(f"empty function call     {empty:8.1f} ns/call  (reference)")
    print(f"Heartbeat.beat(step)    {method:8.1f} ns/call  {method / empty:5.1f}x reference")
    print(f"heartbeat.beat(step)    {module:8.1f} ns/call  {module / empty:5.1f}x reference")
    print(f"agent: os.pread(256 B)   {raw:8.1f} ns/call  (reference)")
    print(f"agent: read+decode slot {read:8.1f} ns/call  {read / raw:5.1f}x reference")
    goal = 2000.0
    verdict = "meets" if module <= goal else "MISSES"
    print(f"goal <= {goal:.0f} ns per module-level beat: {verdict} ({module:.0f} ns)")
    return 0 if module <= goal else 1


if __name__ == "__main__":
    raise SystemExit(main())
