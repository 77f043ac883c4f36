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
from slurm_resilience.config import Config
from slurm_resilience.hooks import steps
from slurm_resilience.hooks.context import HookContext, HookKind, Problem
from slurm_resilience.slurm import reasons
from slurm_resilience.slurm.errors import ForeignDrain, SlurmError

Step = Callable[[HookContext], list[Problem]]

EXIT_OK = 0
EXIT_FAIL = 1

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


def overrun(ctx: HookContext, limit_s: float, what: str = "") -> int:
    """What a hook past its limit does before it exits; returns the exit status.

    Never Slurm's own "Prolog error"/"Epilog error" drain, which nothing resumes:
    under fail-open the job runs (exit 0); under fail-closed the node is drained with our
    reason through the adapter, each call bounded by the watchdog's grace, and the prolog
    then exits 1 so the job is requeued (Slurm keeps a reason already set). When that
    drain can't be confirmed the hook exits 0 rather than leave Slurm's reason behind.
    ``what``: another cause than the limit (the hook server's worker lost), said instead.
    """
    h = ctx.cfg.hooks
    step = ctx.notes.get("step", "?")
    logger = log.get_logger("hooks", hook=ctx.kind)
    message = what or f"couldn't finish within {limit_s:g}s"
    logger.error(f"hooks: {ctx.kind}: {message}", step=step, policy=h.on_internal_error)
    if h.on_internal_error == "fail-open":
        return EXIT_OK
    adapter = ctx.adapter
    adapter.timeout = min(adapter.timeout, h.watchdog_grace_s / 2)  # show node + update
    reason = (f"{ctx.kind} worker lost" if what else
              f"{ctx.kind} over its {limit_s:g}s limit in {step.rsplit(':', 1)[-1]}")
    try:
        adapter.drain(ctx.node, reasons.compose(adapter.prefix, ["hooks"], reason,
                                                owners_last=adapter.owners_last))
    except ForeignDrain as exc:
        logger.warning("node already drained by someone else", error=str(exc))
    except SlurmError as exc:
        logger.error(f"hooks: {ctx.kind}: couldn't drain after the limit; letting the job run",
                     error=str(exc))
        return EXIT_OK
    return EXIT_FAIL if ctx.kind == "prolog" and ctx.cfg.mode != "observe" else EXIT_OK


class Watchdog:
    """A thread that ends the hook even if the main thread is stuck in a syscall.

    At ``limit_s`` it applies :func:`overrun`; should that itself hang past the grace,
    a second timer exits 0 (the job runs) rather than let slurmd kill us and drain.
    ``exit`` is :func:`os._exit` (tests pass a recorder).
    """

    def __init__(self, ctx: HookContext, limit_s: float,
                 exit: Callable[[int], object] = os._exit):
        self.ctx = ctx
        self.limit_s = limit_s
        self.exit = exit
        self._timer = threading.Timer(limit_s, self._fire)
        self._timer.daemon = True
        self._last = threading.Timer(limit_s + ctx.cfg.hooks.watchdog_grace_s, self._give_up)
        self._last.daemon = True

    def start(self) -> Watchdog:
        self._timer.start()
        self._last.start()
        return self

    def cancel(self) -> None:
        self._timer.cancel()
        self._last.cancel()

    def _fire(self) -> None:
        code = EXIT_OK
        try:
            code = overrun(self.ctx, self.limit_s)
        except Exception:  # noqa: BLE001 - the exit below must happen whatever went wrong
            log.get_logger("hooks", hook=self.ctx.kind).exception("hook watchdog failed")
        finally:
            self._last.cancel()
            self.exit(code)

    def _give_up(self) -> None:
        log.get_logger("hooks", hook=self.ctx.kind).error(
            f"hooks: {self.ctx.kind}: couldn't drain within the watchdog's grace; "
            "letting the job run", grace_s=self.ctx.cfg.hooks.watchdog_grace_s)
        self.exit(EXIT_OK)


def run_steps(ctx: HookContext, specs: list[str]) -> list[Problem]:
    """Run each step; a crashing step is a problem only under fail-closed."""
    logger = log.get_logger("hooks", hook=ctx.kind)
    problems: list[Problem] = []
    for spec in specs:
        started = time.monotonic()
        ctx.notes["step"] = spec  # for the watchdog's message
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


def drain_reason(prefix: str, to_drain: list[Problem], owners_last: bool = False) -> str:
    """Who found something, the first finding (the most specific) and a count of the rest:
    short, and recognisable by its structure however it is cut (see slurm.reasons)."""
    more = len(to_drain) - 1 + sum(p.more for p in to_drain)
    return reasons.compose(prefix, [p.step for p in to_drain], to_drain[0].reason, more,
                           owners_last=owners_last)


def act(ctx: HookContext, problems: list[Problem]) -> None:
    """Drain the node once, with the first problem's reason and a count of the others."""
    logger = log.get_logger("hooks", hook=ctx.kind)
    to_drain = [p for p in problems if p.drain]
    if not to_drain:
        return
    reason = drain_reason(ctx.adapter.prefix, to_drain, ctx.adapter.owners_last)
    try:
        ctx.adapter.drain(ctx.node, reason)
    except ForeignDrain as exc:
        logger.warning("node already drained by someone else", error=str(exc))
    except SlurmError as exc:
        logger.error("couldn't drain node", reason=reason, error=str(exc))


def _setup(kind: HookKind, env: Mapping[str, str], cfg: Config | None,
           hook_pid: int | None = None) -> HookContext:
    """Config, context and logging of one hook run. A file that fails to load never
    switches the gate off: the hook gates with the last good copy (or the built-in
    defaults) and says so on stderr and in an error event naming the file, line and key."""
    loaded = None
    if cfg is None:
        from slurm_resilience.config import lastgood

        loaded = lastgood.load(config_path(env))
        cfg = loaded.cfg
        if not loaded.valid:
            print(f"slurm-resilience {kind}: {loaded.problem()}", file=sys.stderr)
    ctx = HookContext.from_env(kind, cfg, env, hook_pid=hook_pid)
    log.configure(mode="json", level=cfg.logging.level, file=cfg.logging.file,
                  use_syslog=cfg.logging.syslog, node=ctx.node, job_id=ctx.job_id)
    if loaded is not None and not loaded.valid:
        ctx.notes["config_invalid"] = loaded.problem()
        log.get_logger("hooks", hook=kind).error(
            f"hooks: {kind}: config: couldn't load; gating with {loaded.gating_with}",
            **loaded.fields())
    return ctx


def main(kind: HookKind, argv: list[str] | None = None, env: Mapping[str, str] | None = None,
         *, cfg: Config | None = None, exit: Callable[[int], object] = os._exit,
         in_process_because: str = "", hook_pid: int | None = None) -> int:
    """Run one hook. ``cfg``: the configuration already loaded (the hook server's);
    ``exit``: how the watchdog ends the process; ``in_process_because``: why the hook
    server did not run this hook (logged, so a node without one is seen); ``hook_pid``:
    the process slurmd started, when it is not this one (the hook server's worker)."""
    env = dict(os.environ if env is None else env)
    ctx = _setup(kind, env, cfg, hook_pid)
    cfg = ctx.cfg
    logger = log.get_logger("hooks", hook=kind)
    if in_process_because:
        logger.info("hook runs in its own process", why=in_process_because)
    timer = Watchdog(ctx, timeout_for(cfg, kind), exit=exit).start()
    started = time.monotonic()
    try:
        problems = run_steps(ctx, STEPS[kind])
        act(ctx, problems)
    finally:
        timer.cancel()
    seconds = round(time.monotonic() - started, 3)
    # slurmd logs a health check's non-zero exit: one more place a broken file shows.
    broken = EXIT_FAIL if kind == "healthcheck" and ctx.notes.get("config_invalid") else EXIT_OK
    if problems:
        logger.warning("hook found problems", problems=[p.reason for p in problems],
                       seconds=seconds)
        # In observe mode the drain was only recorded: the job runs where it was placed.
        fails = kind == "prolog" and cfg.mode != "observe" and any(p.drain for p in problems)
        return EXIT_FAIL if fails else broken
    logger.info("hook ok", seconds=seconds, job_options=ctx.job_options() or None)
    return broken


def worker_lost(kind: HookKind, env: Mapping[str, str], why: str) -> int:
    """The hook server's worker ended without an exit status (killed, say): its steps may
    have acted, so the hook is not run again. Said in the log and on stderr, then the
    failure policy decides, as for a hook past its limit."""
    print(f"slurm-resilience {kind}: {why}", file=sys.stderr)
    ctx = _setup(kind, env, None)
    ctx.notes["step"] = "hook server worker"
    return overrun(ctx, timeout_for(ctx.cfg, kind), what=why)
