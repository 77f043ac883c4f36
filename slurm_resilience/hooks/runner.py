"""Run one hook: load config, run its steps under a watchdog, act on what they found.

Healthy path: no output, no Slurm call, exit 0. On a problem, the node is
drained with our prefixed reason through the adapter; the prolog then exits
non-zero so slurmctld requeues the job onto other nodes.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

from slurm_resilience import config, log
from slurm_resilience.config import Config, ConfigError
from slurm_resilience.hooks import steps
from slurm_resilience.hooks.context import HookContext, HookKind, Problem
from slurm_resilience.slurm import reasons
from slurm_resilience.slurm.errors import ForeignDrain, SlurmError

Step = Callable[[HookContext], list[Problem]]

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_WATCHDOG = 3

STEPS: dict[HookKind, list[str]] = {
    "prolog": steps.PROLOG,
    "epilog": steps.EPILOG,
    "healthcheck": steps.HEALTHCHECK,
}


# Kept under this name for callers that think in hook terms.
config_path = config.job_config_path


def load_step(spec: str) -> Step:
    module, _, func = spec.partition(":")
    fn: Step = getattr(importlib.import_module(module), func)
    return fn


def timeout_for(cfg: Config, kind: HookKind) -> float:
    h = cfg.hooks
    return {"prolog": h.prolog_timeout_s, "epilog": h.epilog_timeout_s,
            "healthcheck": h.healthcheck_timeout_s}[kind]


def _watchdog(seconds: float, kind: str) -> threading.Timer:
    """A thread that ends the process even if the main thread is stuck in a syscall."""

    def fire() -> None:
        log.get_logger("hooks").error("hook watchdog fired", hook=kind, limit_s=seconds)
        os._exit(EXIT_WATCHDOG)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_steps(ctx: HookContext, specs: list[str]) -> list[Problem]:
    """Run each step; a crashing step is a problem only under fail-closed."""
    logger = log.get_logger("hooks", hook=ctx.kind)
    problems: list[Problem] = []
    for spec in specs:
        started = time.monotonic()
        try:
            found = load_step(spec)(ctx)
        except Exception as exc:
            logger.exception("hook step crashed", step=spec)
            if ctx.cfg.hooks.on_internal_error == "fail-closed":
                found = [Problem(spec, f"{ctx.kind} step {spec.rsplit(':', 1)[-1]} crashed: "
                                       f"{type(exc).__name__}")]
            else:
                found = []
        logger.debug("hook step done", step=spec, seconds=round(time.monotonic() - started, 3),
                     problems=len(found))
        problems.extend(found)
    return problems


def drain_reason(prefix: str, to_drain: list[Problem]) -> str:
    """Who found something, the first finding (the most specific) and a count of the rest:
    short, and recognisable by its structure however it is cut (see slurm.reasons)."""
    more = len(to_drain) - 1 + sum(p.more for p in to_drain)
    return reasons.compose(prefix, [p.step for p in to_drain], to_drain[0].reason, more)


def act(ctx: HookContext, problems: list[Problem]) -> None:
    """Drain the node once, with the first problem's reason and a count of the others."""
    logger = log.get_logger("hooks", hook=ctx.kind)
    to_drain = [p for p in problems if p.drain]
    if not to_drain:
        return
    reason = drain_reason(ctx.adapter.prefix, to_drain)
    try:
        ctx.adapter.drain(ctx.node, reason)
    except ForeignDrain as exc:
        logger.warning("node already drained by someone else", error=str(exc))
    except SlurmError as exc:
        logger.error("couldn't drain node", reason=reason, error=str(exc))


def main(kind: HookKind, argv: list[str] | None = None, env: Mapping[str, str] | None = None
         ) -> int:
    env = dict(os.environ if env is None else env)
    try:
        cfg = config.load(config_path(env))
    except ConfigError as exc:
        # Bad config must be loud but must not take the cluster down: say so and let jobs run.
        print(f"slurm-resilience {kind}: {exc}", file=sys.stderr)
        return EXIT_OK if kind != "healthcheck" else EXIT_FAIL
    ctx = HookContext.from_env(kind, cfg, env)
    log.configure(mode="json", level=cfg.logging.level, file=cfg.logging.file,
                  use_syslog=cfg.logging.syslog, node=ctx.node, job_id=ctx.job_id)
    logger = log.get_logger("hooks", hook=kind)
    timer = _watchdog(timeout_for(cfg, kind), kind)
    started = time.monotonic()
    try:
        problems = run_steps(ctx, STEPS[kind])
        act(ctx, problems)
    finally:
        timer.cancel()
    seconds = round(time.monotonic() - started, 3)
    if problems:
        logger.warning("hook found problems", problems=[p.reason for p in problems],
                       seconds=seconds)
        return EXIT_FAIL if kind == "prolog" and any(p.drain for p in problems) else EXIT_OK
    logger.info("hook ok", seconds=seconds, job_options=ctx.job_options() or None)
    return EXIT_OK
