"""Root's log bytes per minute under a user's slot flood: 4,096 mis-sized heartbeat slots of
one job, read by the real watcher once a second for a minute (its clock moved a second a
tick), against the same flood with every refusal logged (the reference: the log before
the budget). Needs root (the slots belong to another uid). Run::

    .venv/bin/python benchmarks/bench_log_flood.py [--slots N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass

from slurm_resilience import log
from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.config.schema import JobTmpfsSection, NodeSection
from slurm_resilience.hang import steps
from slurm_resilience.hang.watcher import HangWatcher
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.logbudget import LogBudget, flush_all
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeRunner

NODE, JOB, UID = "node1", 12, 65534  # nobody owns the job


@dataclass
class Clock:
    """The watcher's clocks, a second a tick: a minute of flood without a minute's wait."""

    mono: float
    wall: float

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall


def flood(tmp: str, slots: int, seconds: int, budgeted: bool) -> tuple[int, int]:
    """Bytes and lines the log gets in ``seconds`` ticks of the watcher over the flood."""
    cfg = Config(node=NodeSection(state_dir=f"{tmp}/state", run_dir=f"{tmp}/run",
                                  job_tmpfs=JobTmpfsSection(enabled=False)),
                 heartbeat=HeartbeatSection(rendezvous="none"))
    ctx = HookContext(kind="prolog", cfg=cfg, node=NODE, env={}, job_id=JOB,
                      uid=UID, gid=UID, user="nobody")
    if steps.prolog_run_dir(ctx):
        raise SystemExit("bench_log_flood: couldn't make the job's run dir (root needed)")
    job_dir = P.job_dir(cfg.node.run_dir, NODE, JOB)
    for rank in range(slots):
        path = os.path.join(job_dir, f"hb-rank-{rank}.slot")
        with open(path, "wb") as f:
            f.write(b"x")  # one byte: a mis-sized slot, refused on every read
        os.chown(path, UID, UID)
    out = f"{tmp}/{'budgeted' if budgeted else 'reference'}.log"
    log.configure(mode="json", level="info", file=out)
    clock = Clock(time.monotonic(), time.time())
    watcher = HangWatcher(cfg, NODE, SlurmAdapter(runner=FakeRunner()), clock=clock,
                          sleep=lambda s: None, config_path="")
    if not budgeted:  # every refusal logged, as before the budget
        watcher.slot_log = LogBudget(log.get_logger("heartbeat"), "refused heartbeat slots",
                                     lines=1 << 62, clock=clock)
    try:
        for _ in range(seconds):
            watcher.tick()
            flush_all()
            clock.mono += 1.0
            clock.wall += 1.0
        flush_all()
    finally:
        watcher.close()
        log.reset()
    with open(out, "rb") as f:
        data = f.read()
    return len(data), data.count(b"\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4096, help="mis-sized slot files")
    parser.add_argument("--seconds", type=int, default=60,
                        help="watcher ticks, one a second of the watcher's clock")
    args = parser.parse_args()
    per_minute = 60.0 / args.seconds
    results = {}
    for budgeted in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            results[budgeted] = flood(tmp, args.slots, args.seconds, budgeted)
    ref_bytes, ref_lines = results[False]
    our_bytes, our_lines = results[True]
    print(f"{args.slots} mis-sized slots, {args.seconds} ticks of 1 s")
    print(f"every refusal logged  {ref_bytes * per_minute:12,.0f} bytes/min "
          f"{ref_lines * per_minute:9,.0f} lines/min  (reference)")
    print(f"with the log budget   {our_bytes * per_minute:12,.0f} bytes/min "
          f"{our_lines * per_minute:9,.0f} lines/min  "
          f"{our_bytes / max(ref_bytes, 1):.5f}x reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
