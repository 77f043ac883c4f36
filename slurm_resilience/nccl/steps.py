"""Hook steps of the NCCL gate (listed in :mod:`slurm_resilience.hooks.steps`).

* prolog: take the node back from idle verification, then decide from the
  cache; only a whole-node job with a stale result (or asking for it) runs the test.
* epilog (``nccl.epilog``): the same test for a stale result, while the node is
  still the job's.
* healthcheck: report a cached failure (so the node stays drained until a test
  passes) and start idle verification in the background when it is due.

Healthy prolog path: one flock on a lock file and one small JSON read; no
torch, no Slurm call.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from slurm_resilience.config import budgets
from slurm_resilience.config.nccl import NcclSection
from slurm_resilience.config.paths import node_path
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.log import get_logger
from slurm_resilience.nccl import cache, lifetime, schedule
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.reasons import owned_by

log = get_logger("nccl")

STEP = "nccl"
DRAINS_FILE = "nccl-drains.json"
# Time the prolog keeps for itself after the test (cache write, drain, exit).
PROLOG_MARGIN_S = 2.0


def lock_path(ctx: HookContext) -> str:
    return os.path.join(node_path(ctx.cfg.node.run_dir, ctx.node), schedule.LOCK_NAME)


def cache_path(ctx: HookContext) -> str:
    return cache.path_for(ctx.cfg.node.state_dir, ctx.node)


def fault_file(ctx: HookContext) -> str:
    s: NcclSection = ctx.cfg.nccl
    return node_path(s.fault_file, ctx.node) if s.fault_file else ""


def current_freshness(ctx: HookContext) -> tuple[cache.Freshness, cache.ResultDoc | None]:
    entry = cache.read(cache_path(ctx))
    s: NcclSection = ctx.cfg.nccl
    return cache.freshness(entry, now=time.time(), validity_s=s.validity_s,
                           boot=cache.boot_id(), fingerprint=cache.fingerprint(s)), entry


def whole_node(ctx: HookContext) -> tuple[bool, str]:
    """Does the job have the node to itself? Asks slurmctld, so only called when
    the cheap checks already say the test would run."""
    if ctx.job_id is None:
        return False, "no job id in the environment"
    try:
        job = ctx.adapter.show_job(ctx.job_id)
        if job.exclusive:
            return True, "exclusive job"
        node = ctx.adapter.show_node(ctx.node)
    except SlurmError as exc:
        return False, f"couldn't ask slurmctld: {exc}"
    if node.cpus and node.alloc_cpus >= node.cpus:
        return True, f"job holds all {node.cpus} CPUs"
    return False, f"node shared ({node.alloc_cpus}/{node.cpus} CPUs allocated)"


def drains_path(ctx: HookContext) -> str:
    return os.path.join(node_path(ctx.cfg.node.state_dir, ctx.node), DRAINS_FILE)


def _keep(what: str, fn: Callable[[], object]) -> None:
    """A state-file write that must never decide the verdict: a read-only or full state dir
    costs the memory of it (said), never the drain of a node that failed."""
    try:
        fn()
    except (OSError, ValueError, TypeError) as exc:
        log.error(f"nccl: couldn't {what}", error=f"{type(exc).__name__}: {exc}")


def _remember(ctx: HookContext, reasons: list[str]) -> None:
    """Note the reasons we drain with, so only a drain entirely ours is ever lifted."""
    path = drains_path(ctx)
    known = cache.read(path) or {}
    old = known.get("reasons", [])
    merged = sorted({str(r) for r in (old if isinstance(old, list) else [])}
                    | set(reasons))[-50:]
    cache.write(path, {"reasons": merged})


def _problems(ctx: HookContext, result_verdict: str, reasons: tuple[str, ...] | list[str]
              ) -> list[Problem]:
    if result_verdict == "fail":
        _keep("record the reasons we drain with", lambda: _remember(ctx, list(reasons)))
        return [Problem(STEP, r) for r in reasons]
    if result_verdict == "unknown":
        log.warning("nccl: couldn't check", reasons=list(reasons))
    return []


def maybe_resume(ctx: HookContext) -> bool:
    """After a passing test, lift a drain whose owner tag is ours alone (any length)."""
    path = drains_path(ctx)
    ours = cache.read(path)
    if not ours:
        return False
    adapter = ctx.adapter
    try:
        node = adapter.show_node(ctx.node)
        if not node.drained:
            _keep("forget our drain", lambda: os.unlink(path))
            return False
        known = ours.get("reasons")
        if not owned_by(node.reason, adapter.prefix, STEP,
                        [str(r) for r in known] if isinstance(known, list) else []):
            log.info("nccl: drain not (only) ours; not resuming", reason=node.reason)
            return False
        resumed = adapter.resume(ctx.node)
    except SlurmError as exc:
        log.warning("nccl: couldn't resume after a passing test", error=str(exc))
        return False
    _keep("forget our drain", lambda: os.unlink(path))
    if resumed:
        log.warning("nccl: test passes again: node resumed", previous_reason=node.reason)
    return resumed


def _run_inline(ctx: HookContext, lock: schedule.NodeLock, budget_s: float, why: str,
                node_use: str) -> list[Problem]:
    """Run the test now, holding ``lock``, within ``budget_s`` for all attempts."""
    from slurm_resilience.nccl.gate import run_gate

    s: NcclSection = ctx.cfg.nccl
    per_attempt = max(budget_s / (s.retries + 1), 1.0)
    if per_attempt < s.timeout_s:
        # A hook cannot outlive its own limit; say so, so that a short prolog limit is
        # seen for what it is when a slow node is reported as timed out.
        log.warning("nccl: hook limit shortens the test's timeout", hook=ctx.kind,
                    timeout_s=round(per_attempt, 1), configured_s=s.timeout_s)
    log.info("nccl: running the test", hook=ctx.kind, why=why, node_use=node_use,
             timeout_s=round(per_attempt, 1))
    try:
        result = run_gate(s, fault_file=fault_file(ctx), timeout_s=per_attempt)
    finally:
        lock.release()
    if result.verdict != "aborted":
        # This hook reports the failure itself: mark it so, for cached_failure().
        entry = result.to_json()
        if result.verdict == "fail":
            entry["reported"] = time.time()
        _keep("cache the result", lambda: cache.store(cache_path(ctx), entry))
    return _problems(ctx, result.verdict, result.reasons)


def prolog(ctx: HookContext) -> list[Problem]:
    s: NcclSection = ctx.cfg.nccl
    if not s.enabled:
        if budgets.idle_diag(ctx.cfg):
            # Idle diagnostics hold the same lock: take the node back from them.
            lock = schedule.NodeLock(lock_path(ctx))
            handoff = schedule.take_over(lock, s.handoff_timeout_s)
            if handoff.held:
                ctx.notes["nccl_handoff_s"] = round(handoff.seconds, 3)
            lock.release()
        return []
    started = time.monotonic()
    lock = schedule.NodeLock(lock_path(ctx))
    handoff = schedule.take_over(lock, s.handoff_timeout_s)
    if handoff.held:
        ctx.notes["nccl_handoff_s"] = round(handoff.seconds, 3)
    if not handoff.locked:
        return []  # someone else is testing the node: the job goes on, untested
    fresh, _entry = current_freshness(ctx)
    decision = schedule.decide_prolog(enabled=s.prolog, fresh=fresh.fresh, stale_why=fresh.why,
                                      asks=schedule.job_asks(ctx.env, s.prolog_always))
    if not decision.run:
        lock.release()
        return []
    whole, how = whole_node(ctx)
    if not whole:
        lock.release()
        log.info("nccl: test due but not run in this prolog", why=decision.why, node_use=how)
        return []
    budget = ctx.cfg.hooks.prolog_timeout_s - PROLOG_MARGIN_S - (time.monotonic() - started)
    return _run_inline(ctx, lock, min(budget, s.timeout_s * (s.retries + 1)), decision.why,
                       how)


def epilog(ctx: HookContext) -> list[Problem]:
    s: NcclSection = ctx.cfg.nccl
    if not (s.enabled and s.epilog):
        return []
    started = time.monotonic()
    fresh, _entry = current_freshness(ctx)
    if fresh.fresh:
        return []
    whole, how = whole_node(ctx)
    if not whole:
        log.info("nccl: test due, left for idle verification", why=fresh.why, node_use=how)
        return []
    lock = schedule.NodeLock(lock_path(ctx))
    if not lock.try_acquire():
        return []  # someone is testing already
    budget = ctx.cfg.hooks.epilog_timeout_s - PROLOG_MARGIN_S - (time.monotonic() - started)
    return _run_inline(ctx, lock, min(budget, s.timeout_s * (s.retries + 1)), fresh.why, how)


def verifier_argv(ctx: HookContext, owner: lifetime.Owner | None = None) -> list[str]:
    from slurm_resilience.config import job_config_path

    argv = [sys.executable, "-I", "-m", "slurm_resilience.nccl.verify", "--node", ctx.node]
    if owner is not None:
        argv += ["--owner", owner.arg()]
    path = job_config_path(ctx.env)
    return [*argv, "--config", path] if path else argv


def start_idle_verification(ctx: HookContext) -> int:
    """Start the verifier detached (own session, no inherited pipes), so the health
    run returns at once and slurmd's limit on it never cuts the test short; it is
    told which slurmd it must not outlive: the one above the hook slurmd started, which
    is not this process's parent when the hook server runs the health check."""
    owner = lifetime.find_owner(ctx.hook_pid)
    if owner is None:
        log.warning("nccl: no slurmd or agent above this health run; the idle verifier "
                    "is bounded by its test's deadline only")
    from slurm_resilience import proc  # the idle path only: off every prolog's import path

    child = proc.spawn(verifier_argv(ctx, owner), env=ctx.env)
    log.info("nccl: idle verifier spawned", pid=child.pid,
             owner=owner.pid if owner is not None else None)
    return child.pid


def cached_failure(ctx: HookContext, entry: cache.ResultDoc) -> list[Problem]:
    """A failed result drains the node (again, should the drain be lost) until a test
    passes; but once it has been reported, a node found in service again was put back
    by someone on purpose: that invalidates the result, and the next chance re-tests."""
    reasons = entry.get("reasons", [])
    listed = [str(r) for r in reasons]
    problems = _problems(ctx, "fail", listed)
    if not entry.get("reported"):
        _keep("mark the failure reported",
              lambda: cache.write(cache_path(ctx), {**entry, "reported": time.time()}))
        return problems
    try:
        node = ctx.adapter.show_node(ctx.node)
    except SlurmError as exc:
        log.warning("nccl: couldn't read node state", error=str(exc))
        return problems
    if node.drained or node.down:
        return problems
    cache.invalidate(cache_path(ctx), "node returned to service")
    log.info("nccl: node returned to service; failed result invalidated", reasons=reasons)
    return []


def healthcheck(ctx: HookContext) -> list[Problem]:
    s: NcclSection = ctx.cfg.nccl
    if not s.enabled:
        return []
    fresh, entry = current_freshness(ctx)
    problems: list[Problem] = []
    failed = entry is not None and entry.get("verdict") == "fail" and \
        not entry.get("invalidated")
    if entry is not None and failed:
        problems = cached_failure(ctx, entry)
        if not problems:
            fresh, entry = current_freshness(ctx)
    if ctx.after_rank_death:
        return problems  # no resume and no idle test from a run a job's death asked for
    if not failed and fresh.fresh and os.path.exists(drains_path(ctx)):
        maybe_resume(ctx)
    if not s.idle_verify or not schedule.idle_due(fresh=fresh.fresh, age_s=fresh.age_s,
                                                  interval_s=s.idle_interval_s):
        return problems
    if schedule.holder_pid(lock_path(ctx)) is not None:
        return problems  # a test is running
    try:
        idle = ctx.adapter.show_node(ctx.node).idle
    except SlurmError as exc:
        log.warning("nccl: couldn't read node state for idle verification", error=str(exc))
        return problems
    if idle:
        start_idle_verification(ctx)
    return problems
