"""Idle-node verification: ``python -m slurm_resilience.nccl.verify --node NAME``.

Started detached by the HealthCheckProgram step when the node is idle and its
result is due. It holds the node lock for the whole test, re-checks that the
node is still idle once it has the lock (a job allocated before that point
finds the lock held and takes it back), runs the ranks at low priority, and on
SIGTERM (a job's prolog taking the node back) kills its ranks, caches nothing
and lets go. A failure is cached; the next health run drains the node with it.
With ``--owner`` (the slurmd that ran the healthcheck) it does the same once that
process has ended, so it never outlives slurmd (:mod:`slurm_resilience.nccl.lifetime`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from types import FrameType

from slurm_resilience import config, log
from slurm_resilience.config.paths import node_name, node_path
from slurm_resilience.nccl import cache, lifetime, schedule
from slurm_resilience.nccl.gate import run_gate
from slurm_resilience.slurm.adapter import from_config
from slurm_resilience.slurm.errors import SlurmError

EXIT_OK = 0
EXIT_ERROR = 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slurm_resilience.nccl.verify")
    p.add_argument("--node", default="")
    p.add_argument("--config", default=None)
    p.add_argument("--owner", type=lifetime.Owner.parse, default=None,
                   help="PID:START of the process this must not outlive (slurmd)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()
    owner_gone = threading.Event()

    def on_owner_gone() -> None:
        owner_gone.set()
        stop.set()

    if args.owner is not None:
        if not lifetime.alive(args.owner):
            print(f"nccl verify: owner {args.owner.pid} has ended; not starting",
                  file=sys.stderr)
            return EXIT_OK
        lifetime.watch(args.owner, on_owner_gone)
    try:
        cfg = config.load(args.config)
    except config.ConfigError as exc:
        print(f"nccl verify: {exc}", file=sys.stderr)
        return EXIT_ERROR
    node = node_name(args.node or cfg.node.name)
    log.configure(mode="json", level=cfg.logging.level, file=cfg.logging.file,
                  use_syslog=cfg.logging.syslog, node=node)
    logger = log.get_logger("nccl", phase="idle-verify")
    s = cfg.nccl

    lock = schedule.NodeLock(os.path.join(node_path(cfg.node.run_dir, node), schedule.LOCK_NAME))
    if not lock.try_acquire():
        logger.info("nccl: idle verification: node lock busy; not starting")
        return EXIT_OK

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            info = from_config(cfg).show_node(node)
        except SlurmError as exc:
            logger.warning("nccl: idle verification: couldn't read node state", error=str(exc))
            return EXIT_ERROR
        if not info.idle:
            logger.info("nccl: idle verification: node no longer idle", state=info.state)
            return EXIT_OK
        path = cache.path_for(cfg.node.state_dir, node)
        fresh = cache.freshness(cache.read(path), now=time.time(), validity_s=s.validity_s,
                                boot=cache.boot_id(), fingerprint=cache.fingerprint(s))
        if not schedule.idle_due(fresh=fresh.fresh, age_s=fresh.age_s,
                                 interval_s=s.idle_interval_s):
            return EXIT_OK
        if stop.is_set():
            logger.info(_stopped_why(owner_gone), seconds=0.0)
            return EXIT_OK
        logger.info("nccl: idle verification started", why=fresh.why)
        fault = node_path(s.fault_file, node) if s.fault_file else ""
        result = run_gate(s, fault_file=fault, nice=s.nice, stop=stop)
        if result.verdict == "aborted" or stop.is_set():
            logger.info(_stopped_why(owner_gone),
                        seconds=round(result.seconds, 3))
            return EXIT_OK
        cache.store(path, result.to_json())
        logger.info("nccl: idle verification done", verdict=result.verdict,
                    reasons=list(result.reasons), seconds=round(result.seconds, 3))
        return EXIT_OK
    finally:
        lock.release()


def _stopped_why(owner_gone: threading.Event) -> str:
    if owner_gone.is_set():
        return "nccl: idle verification stopped: slurmd has ended"
    return "nccl: idle verification stopped: a job arrived"


if __name__ == "__main__":
    sys.exit(main())
