"""Active diagnostics on an idle node: ``python -m slurm_resilience.health.idle_diag``.

Scheduled like the NCCL idle verification, and under the same node lock
(``<run_dir>/nccl.lock``), so the two never load the GPUs at once and a job's
prolog takes the node back from either one the same way: it signals the lock's
holder (:func:`slurm_resilience.nccl.schedule.take_over`). Here SIGTERM kills
this process's whole group (the collector child and the ``dcgmi`` or torch test
under it), which frees the lock at once and records nothing. HealthCheckProgram
starts it detached when ``health.diag.idle_interval_s`` has passed since the last
run and the node is idle; this re-checks idleness once it holds the lock. Its
result is recorded in the health state (``idle_diag.json``); HealthCheckProgram
keeps the node drained on a failed run until a later one passes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config import Config

RECORD = "idle_diag"  # state file in the node's health state directory
EXIT_OK = 0
EXIT_ERROR = 1


@dataclass(frozen=True)
class IdleRecord:
    """The last idle run: when it ended, and the drain reason when it failed."""

    time: float
    healthy: bool
    reason: str = ""

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> IdleRecord | None:
        t, healthy, reason = d.get("time"), d.get("healthy"), d.get("reason", "")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not isinstance(healthy, bool):
            return None
        return cls(float(t), healthy, str(reason))

    def to_state(self) -> dict[str, Any]:
        return {"time": self.time, "healthy": self.healthy, "reason": self.reason}


def due(last: IdleRecord | None, now: float, interval_s: float) -> bool:
    """Pure: a run is due when scheduling is on and the last run (if any) is that old."""
    if interval_s <= 0:
        return False
    return last is None or now - last.time >= interval_s or now < last.time


def run_idle(cfg: Config, node: str, is_idle: Callable[[], bool],
             clock: Clock = SystemClock()) -> IdleRecord | None:
    """Hold the node lock, re-check that the node is idle, run the diagnostics and record
    the result. None when it did not run (lock busy, node no longer idle)."""
    from slurm_resilience.config.paths import node_path
    from slurm_resilience.health import gate, steps
    from slurm_resilience.log import get_logger
    from slurm_resilience.nccl import schedule

    logger = get_logger("health", phase="idle-diag")
    lock = schedule.NodeLock(os.path.join(node_path(cfg.node.run_dir, node), schedule.LOCK_NAME))
    if not lock.try_acquire():
        logger.info("health: idle diagnostics: node lock busy (a test or a job); not starting")
        return None

    def on_term(signum: int, frame: FrameType | None) -> None:
        logger.info("health: idle diagnostics stopped: a job arrived")
        if os.getpgrp() == os.getpid():
            # Our group: this process, the collector child and the tool it runs. The
            # kernel frees the lock with us; nothing is recorded.
            os.killpg(os.getpgrp(), signal.SIGKILL)
        raise SystemExit(EXIT_OK)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if not is_idle():
            logger.info("health: idle diagnostics: node no longer idle")
            return None
        logger.info("health: idle diagnostics started", tool=cfg.health.diag.tool,
                    diag_level=cfg.health.diag.level)
        # GPUDirect RDMA loopback too, where perftest is installed (else it is off here;
        # `check --only gdr` says "not installed").
        gdr = cfg.health.gdr.enabled and shutil.which("ib_write_bw") is not None
        report = gate.run(cfg, node, "idle", only=("diag", "gdr") if gdr else ("diag",))
        steps.count_results(cfg, node, "idle", report)
        record = IdleRecord(clock.time(), report.verdict.healthy,
                            "" if report.verdict.healthy else report.verdict.reason())
        store = gate.StateStore(gate.state_dir(cfg, node))
        store.save(RECORD, record.to_state())
        logger.info("health: idle diagnostics done", healthy=record.healthy,
                    findings=[f.to_dict() for f in report.findings if f.severity > 0])
        return record
    finally:
        signal.signal(signal.SIGTERM, previous)
        lock.release()


def argv(node: str, owner: str | None, config_path: str | None) -> list[str]:
    """The detached runner's command line (its module name marks it as ours to the
    hand-off, :data:`slurm_resilience.nccl.schedule.OUR_MARKS`)."""
    out = [sys.executable, "-I", "-m", "slurm_resilience.health.idle_diag", "--node", node]
    if owner:
        out += ["--owner", owner]
    return [*out, "--config", config_path] if config_path else out


def main(args_in: list[str] | None = None) -> int:
    from slurm_resilience import config, log
    from slurm_resilience.config.paths import node_name
    from slurm_resilience.nccl import lifetime
    from slurm_resilience.slurm.adapter import from_config
    from slurm_resilience.slurm.errors import SlurmError

    p = argparse.ArgumentParser(prog="slurm_resilience.health.idle_diag",
                                description="active GPU diagnostics on an idle node")
    p.add_argument("--node", default="", help="node name (default: node.name)")
    p.add_argument("--config", default=None, help="configuration file")
    p.add_argument("--owner", type=lifetime.Owner.parse, default=None,
                   help="PID:START of the process this must not outlive (slurmd)")
    args = p.parse_args(sys.argv[1:] if args_in is None else args_in)
    if args.owner is not None:
        if not lifetime.alive(args.owner):
            return EXIT_OK
        # slurmd gone: stop as a job's hand-off would.
        lifetime.watch(args.owner, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        cfg = config.load(args.config)
    except config.ConfigError as exc:
        print(f"idle diagnostics: {exc}", file=sys.stderr)
        return EXIT_ERROR
    node = node_name(args.node or cfg.node.name)
    log.configure(mode="json", level=cfg.logging.level, file=cfg.logging.file,
                  use_syslog=cfg.logging.syslog, node=node)

    def is_idle() -> bool:
        try:
            return from_config(cfg).show_node(node).idle
        except SlurmError as exc:
            log.get_logger("health").warning("health: idle diagnostics: couldn't read node "
                                             "state; not running", error=str(exc))
            return False

    run_idle(cfg, node, is_idle)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
