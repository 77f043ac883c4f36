"""Evidence capture of many ranks with a py-spy that never answers: time until the incident
goes on, against its configured bound (a plain wait of the same length, same run).

Issue 10 found 80 slots taking 10.1 s against an intended ~3 s. Run::

    .venv/bin/python benchmarks/bench_evidence.py [--slots 256] [--timeout 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from slurm_resilience.hang import evidence
from slurm_resilience.heartbeat.slot import SlotView
from slurm_resilience.heartbeat.writer import process_start_ticks

# A py-spy stand-in stuck like py-spy on a process in D-state; its child holds the pipes.
SLOW_PY_SPY = "#!/bin/sh\nsleep 600\n"


def slots(count: int) -> list[SlotView]:
    """``count`` slots of this very process (it passes the pid, start time and uid checks)."""
    me, start = os.getpid(), process_start_ticks()
    return [SlotView(rank=r, world_size=count, local_rank=r, pid=me, pid_start=start, job_id=1,
                     restart_count=0, clock_offset=0.0, created=0.0, job_step_timeout_s=1.0,
                     flags=0, step=1, last_beat=0.0, beats=1, last_dt=0.0, ewma_dt=0.0,
                     min_dt=0.0, max_dt=0.0, ckpt_step=-1, section_start=0.0,
                     section_timeout_s=0.0, section="") for r in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=256, help="ranks on the node")
    parser.add_argument("--timeout", type=float, default=3.0, help="evidence_timeout_s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fake = os.path.join(tmp, "py-spy")
        with open(fake, "w") as fh:
            fh.write(SLOW_PY_SPY)
        os.chmod(fake, 0o755)
        t0 = time.monotonic()
        threading.Event().wait(args.timeout)
        reference = time.monotonic() - t0
        t0 = time.monotonic()
        out = evidence.capture_ranks_bounded(slots(args.slots), os.getuid(), py_spy=fake,
                                             timeout=args.timeout)
        ours = time.monotonic() - t0
    print(f"{args.slots} slots, py-spy never answers, evidence_timeout_s={args.timeout:g}: "
          f"{ours:.2f} s ({ours / reference:.3f}x of a plain {reference:.2f} s wait; goal "
          f"<= 1.1x); {len(out.timed_out)} ranks timed out, {out.children_started} py-spy "
          f"started, {len(out.children_unreaped)} left unreaped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
