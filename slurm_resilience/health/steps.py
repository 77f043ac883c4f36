"""Hook steps of the health gate: ``prolog``, ``epilog`` and ``healthcheck``.

Prolog and epilog only read (no slurmctld call unless the node is sick).
HealthCheckProgram runs every check, resumes a node the gate drained once it
has passed ``resume_after_passes`` runs in a row, and releases jobs held
because our prolog failed. It never touches a drain whose reason is not
entirely one the gate itself set, nor a node in a state it does not know.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from slurm_resilience import events, log
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.slurm import reasons
from slurm_resilience.slurm.errors import ForeignDrain, JobNotFound, SlurmError
from slurm_resilience.slurm.parse import JOB_FINAL_STATES

if TYPE_CHECKING:
    from slurm_resilience.config import Config
    from slurm_resilience.health.gate import StateStore

STEP = "health"
OURS = "drains"  # state file: reasons we drained with, jobs our prolog failed
_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")
# Node states the healthcheck understands well enough to resume from.
_RESUMABLE_STATES = {"IDLE", "MIXED", "ALLOCATED"}
_RESUMABLE_FLAGS = {"DRAIN", "DRAINING", "DRAINED"}
_HELD_REASON = "launch failed requeued held"
MAX_JOBS = 1000  # job start times kept for the epilog
# Kernel-log stamps are microseconds since boot, made wall time with the clocks of the
# moment they are read; a clock adjustment between the Xid and the epilog moves them.
JOB_START_MARGIN_S = 2.0
# A clean healthcheck looks at the node's reason this often even when it remembers no drain
# of its own: that memory is lost when the state dir was unusable as the gate drained.
LOOK_EVERY_PASSES = 10
T = TypeVar("T")


@dataclass(frozen=True)
class DrainMemory:
    """What the hooks remember of their own drains (the ``drains`` state file)."""

    streak: int = 0  # clean healthcheck runs in a row
    drained: bool = False  # the gate drained the node and hasn't seen it resumed
    reasons: tuple[str, ...] = ()  # reasons an earlier release drained with
    failed_jobs: tuple[int, ...] = ()  # jobs our prolog failed, to release once requeued

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DrainMemory:
        """Field by field: a mangled field is read as its default (a mangled streak starts
        again rather than block every later resume; only job ids that are integers)."""
        legacy = data.get("reasons")
        return cls((_ints([data.get("streak")]) or [0])[0], bool(data.get("drained")),
                   tuple(str(r) for r in legacy) if isinstance(legacy, list) else (),
                   tuple(_ints(data.get("failed_jobs"))))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"streak": self.streak, "failed_jobs": list(self.failed_jobs)}
        if self.drained:
            out["drained"] = True
        if self.reasons:
            out["reasons"] = list(self.reasons)
        return out


def gres_gpus(gres: str) -> int | None:
    """``gpu:h100:8(S:0-1)`` → 8; sums several gpu entries; None without gpu gres."""
    counts = [int(n) for n in _GRES_GPU.findall(gres)]
    return sum(counts) if counts else None


def job_gpu_ids(env: dict[str, str] | Any) -> frozenset[int] | None:
    """GPU indices given to the job (``SLURM_JOB_GPUS=0,3``); None without gpu gres."""
    ids = [int(x) for x in str(env.get("SLURM_JOB_GPUS", "")).split(",") if x.strip().isdigit()]
    return frozenset(ids) if ids else None


def job_gpus(env: dict[str, str] | Any) -> int | None:
    """A lower bound from the job: GPU ids it was given (``SLURM_JOB_GPUS=0,3``) must exist."""
    ids = job_gpu_ids(env)
    return max(ids) + 1 if ids else None


def _store(ctx: HookContext) -> StateStore:
    """One store per hook run, so what one read found unusable is known to the next."""
    from slurm_resilience.health.gate import StateStore, state_dir

    store = ctx.notes.get("health_store")
    if not isinstance(store, StateStore):
        store = ctx.notes["health_store"] = StateStore(state_dir(ctx.cfg, ctx.node))
    return store


def _bookkeeping(ctx: HookContext, what: str, fn: Callable[[], T], default: T) -> T:
    """Run a state-file read or write that must never decide the verdict.

    The verdict is already made when this runs; an unusable ``state_dir`` (read-only,
    full, not a directory, garbage inside) costs only the history, and is said.
    """
    try:
        return fn()
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.get_logger("health", hook=ctx.kind).warning(
            f"health: {ctx.kind}: couldn't {what}", error=f"{type(exc).__name__}: {exc}")
        return default


def _remember(ctx: HookContext) -> None:
    """Note that we drained (so the healthcheck looks for its own drain to resume) and,
    in the prolog, which job we failed."""
    store = _store(ctx)
    fd = store.lock()
    try:
        ours = dataclasses.replace(store.load_state(OURS, DrainMemory), drained=True, streak=0)
        if ctx.kind == "prolog" and ctx.job_id is not None:
            held = [j for j in ours.failed_jobs if j != ctx.job_id]
            ours = dataclasses.replace(ours, failed_jobs=tuple([*held, ctx.job_id][-50:]))
        store.save(OURS, ours.to_json())
    finally:
        os.close(fd)


def _gate(ctx: HookContext, kind: str, expected: int | None, job_start: float | None = None
          ) -> list[Problem]:
    return _problems(ctx, _report(ctx, kind, expected, job_start))


def _report(ctx: HookContext, kind: str, expected: int | None, job_start: float | None = None
            ) -> Any:
    from slurm_resilience.health import gate

    report = gate.run(ctx.cfg, ctx.node, kind, expected_gpus=expected, job_start=job_start,
                      job_gpus=job_gpu_ids(ctx.env) if kind == "prolog" else None)
    count_results(ctx.cfg, ctx.node, kind, report)
    return report


def _problems(ctx: HookContext, report: Any) -> list[Problem]:
    logger = log.get_logger("health", hook=ctx.kind)
    notable = [f.to_dict() for f in report.findings if f.severity > 0]
    if report.verdict.healthy:
        if notable:
            logger.info("health findings", findings=notable)
        return []
    blocking = report.verdict.blocking
    logger.warning("health gate failed", reason=report.verdict.reason(), findings=notable,
                   seconds=report.seconds)
    problems = [Problem(STEP, blocking[0].reason, more=len(blocking) - 1)]
    _bookkeeping(ctx, "record that the node was drained", lambda: _remember(ctx), None)
    return problems


def count_results(cfg: Config, node: str, kind: str, report: Any) -> None:
    """Each check's worst result, for the agent's metrics (one small locked file write)."""
    from slurm_resilience import events
    from slurm_resilience.health.findings import Severity

    ran = [name for name in report.seconds if name != "total"]
    results = {name: max((f.severity for f in report.findings if f.check == name),
                         default=Severity.OK).name.lower() for name in ran}
    events.gate_results(events.path_for(cfg.node.state_dir, node), kind, results)


def prolog(ctx: HookContext) -> list[Problem]:
    """Passive checks before the job starts; silent when healthy."""
    # The job's start is this moment (slurmctld shows the job RUNNING while its prolog
    # runs), but it is written only after the verdict.
    started = time.time()
    problems = _gate(ctx, "prolog", job_gpus(ctx.env))
    if ctx.job_id is not None:
        _bookkeeping(ctx, "record the job's start time",
                     lambda: _note_job_start(ctx, started), None)
    return problems


def _note_job_start(ctx: HookContext, now: float) -> None:
    store = _store(ctx)
    starts = {k: v for k, v in store.load("jobs").items()  # garbage entries are dropped
              if isinstance(v, (int, float)) and now - float(v) < 14 * 86400}
    starts[str(ctx.job_id)] = now
    if len(starts) > MAX_JOBS:  # a busy node: keep the newest
        starts = dict(sorted(starts.items(), key=lambda kv: float(kv[1]))[-MAX_JOBS:])
    store.save("jobs", starts)


def _job_start(ctx: HookContext) -> float | None:
    value = _store(ctx).load("jobs").get(str(ctx.job_id))
    return float(value) if isinstance(value, (int, float)) else None


def epilog(ctx: HookContext) -> list[Problem]:
    """The prolog's checks plus the Xids raised while the job ran; then, when configured
    and those found a GPU failing, the active diagnostics."""
    report = _report(ctx, "epilog", job_gpus(ctx.env), job_start=xids_since(ctx))
    problems = _problems(ctx, report)
    d = ctx.cfg.health.diag
    if d.enabled and d.after_failure and gpu_failed(report):
        problems += _diag_after_failure(ctx)
    if problems:
        from slurm_resilience.health.faultrequeue import after_fault

        # A fault that drains the node may have killed the job: it restarts elsewhere.
        after_fault(ctx, problems[0].reason)
    return problems


# Checks whose failure calls for the active diagnostics after a job.
DIAG_TRIGGERS = ("gpu", "xid")


def gpu_failed(report: Any) -> bool:
    """Pure: the epilog's own checks found a GPU failing (a draining gpu or xid finding),
    or an Xid repeating on one GPU asks for the diagnostic NVIDIA names for it (13, 31).
    Other warnings (an application's lone Xid 13, one VBIOS per model) run no tests."""
    return (any(f.check in DIAG_TRIGGERS for f in report.verdict.blocking)
            or any(f.check == "xid" and f.data.get("diagnose") for f in report.findings))


def _diag_after_failure(ctx: HookContext) -> list[Problem]:
    """``dcgmi diag`` (or the torch test) at ``after_failure_level``, bounded by
    ``after_failure_timeout_s`` (held in the epilog's budget: config/budgets.py). A clean
    run records a repair for the Xid check, as any clean diagnostic does."""
    import dataclasses

    from slurm_resilience.health import gate

    h = ctx.cfg.health
    diag = dataclasses.replace(h.diag, level=h.diag.after_failure_level,
                               timeout_s=h.diag.after_failure_timeout_s)
    cfg = dataclasses.replace(ctx.cfg, health=dataclasses.replace(h, diag=diag))
    log.get_logger("health", hook=ctx.kind).warning(
        "health: a GPU failed: running active diagnostics", diag_level=diag.level,
        timeout_s=diag.timeout_s, tool=diag.tool)
    report = gate.run(cfg, ctx.node, "epilog", only=("diag",))
    count_results(ctx.cfg, ctx.node, "epilog", report)
    return _problems(ctx, report)


def xids_since(ctx: HookContext) -> float:
    """From when the epilog counts an Xid as raised during the job: never later than the
    job's start. The prolog's start (taken before Slurm starts the job) less a margin for
    kernel-log stamps, which are boot-relative and turned into wall time on each read;
    without a record of it, the whole window (a job-time Xid is never taken for older)."""
    start = None
    if ctx.job_id is not None:
        start = _bookkeeping(ctx, "read the job's start time", lambda: _job_start(ctx), None)
    if start is None:
        log.get_logger("health", hook=ctx.kind).info(
            "no record of the job's start: every Xid in the window counts as during the job")
        return 0.0
    return start - JOB_START_MARGIN_S


def healthcheck(ctx: HookContext) -> list[Problem]:
    """Every check; then resume our drain after N passes and release jobs we got held."""
    h = ctx.cfg.health
    expected = None
    logger = log.get_logger("health", hook=ctx.kind)
    if h.gpu.expected_count < 0:
        try:
            expected = gres_gpus(ctx.adapter.show_node(ctx.node).gres)
        except SlurmError as exc:
            logger.warning("couldn't read the node's gres; GPU count not checked", error=str(exc))
    problems = _gate(ctx, "healthcheck", expected)
    if ctx.after_rank_death:
        return problems  # drain on evidence; the periodic runs keep the streak and the rest
    problems += _idle_diag(ctx)
    if h.release_held_jobs:
        # Whether or not this node is healthy now: the node is drained, so a released
        # job is scheduled elsewhere.
        failed: list[int] = _bookkeeping(ctx, "read the jobs our prolog failed",
                                         lambda: _failed_jobs(ctx), [])
        if failed:
            _release_held(ctx, failed)
    if problems:
        return problems
    ours = _bookkeeping(ctx, "record the streak of clean runs", lambda: _count_pass(ctx), None)
    if ours is not None and ours.streak >= h.resume_after_passes and (
            ours.drained or ours.reasons or ours.streak % LOOK_EVERY_PASSES == 0):
        _maybe_resume(ctx, ours)
    return []


def _idle_diag(ctx: HookContext) -> list[Problem]:
    """Keep the node drained while the last idle diagnostic run failed; start the next
    run in the background when it is due and the node is idle."""
    from slurm_resilience.health import idle_diag

    d = ctx.cfg.health.diag
    if not d.enabled or d.idle_interval_s <= 0:
        return []
    logger = log.get_logger("health", hook=ctx.kind)
    last = _bookkeeping(ctx, "read the last idle diagnostics",
                        lambda: idle_diag.IdleRecord.from_state(_store(ctx).load(
                            idle_diag.RECORD)), None)
    problems = [] if last is None or last.healthy else [
        Problem(STEP, last.reason.removeprefix("health: ") or "idle diagnostics failed")]
    if problems:
        # As any failure of ours: the streak starts again, and the drain is remembered
        # so a later passing run resumes it.
        _bookkeeping(ctx, "record that the node was drained", lambda: _remember(ctx), None)
    if idle_diag.due(last, time.time(), d.idle_interval_s):
        _maybe_start_idle_diag(ctx, logger)
    return problems


def _maybe_start_idle_diag(ctx: HookContext, logger: Any) -> None:
    from slurm_resilience import proc
    from slurm_resilience.config import job_config_path
    from slurm_resilience.config.paths import node_path
    from slurm_resilience.health import idle_diag
    from slurm_resilience.nccl import lifetime, schedule

    lock = os.path.join(node_path(ctx.cfg.node.run_dir, ctx.node), schedule.LOCK_NAME)
    if schedule.holder_pid(lock) is not None:
        return  # an NCCL test or a diagnostic holds the node: next time
    try:
        if not ctx.adapter.show_node(ctx.node).idle:
            return
    except SlurmError as exc:
        logger.warning("health: couldn't read node state for idle diagnostics",
                       error=str(exc))
        return
    owner = lifetime.find_owner(ctx.hook_pid)
    # Detached, as the NCCL idle verifier: slurmd's limit on this run never cuts it short.
    child = proc.spawn(
        idle_diag.argv(ctx.node, owner.arg() if owner else None, job_config_path(ctx.env)),
        env=ctx.env)
    logger.info("health: idle diagnostics spawned", pid=child.pid)


def _ints(value: object) -> list[int]:
    """The integers of a list read from a state file (anything else there is garbage)."""
    items = value if isinstance(value, list) else []
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


def _failed_jobs(ctx: HookContext) -> list[int]:
    return list(_store(ctx).load_state(OURS, DrainMemory).failed_jobs)


def _count_pass(ctx: HookContext) -> DrainMemory:
    store = _store(ctx)
    fd = store.lock()
    try:
        ours = store.load_state(OURS, DrainMemory)
        # What we drained was lost with an unusable file: look at the node's reason once,
        # so a drain of ours is still resumed (a reason that isn't ours is left alone).
        ours = dataclasses.replace(ours, streak=ours.streak + 1,
                                   drained=ours.drained or OURS in store.quarantined)
        store.save(OURS, ours.to_json())
    finally:
        os.close(fd)
    return ours


def _forget_drain(ctx: HookContext) -> None:
    store = _store(ctx)
    fd = store.lock()
    try:
        ours = store.load_state(OURS, DrainMemory)
        store.save(OURS, dataclasses.replace(ours, drained=False, reasons=()).to_json())
    finally:
        os.close(fd)


def _maybe_resume(ctx: HookContext, ours: DrainMemory) -> None:
    logger = log.get_logger("health", hook=ctx.kind)
    adapter = ctx.adapter
    try:
        node = adapter.show_node(ctx.node)
    except SlurmError as exc:
        logger.warning("couldn't read node state; not resuming", error=str(exc))
        return
    if not node.drained:
        _bookkeeping(ctx, "record that our drain is over", lambda: _forget_drain(ctx), None)
        return
    if node.state not in _RESUMABLE_STATES or not node.flags <= _RESUMABLE_FLAGS:
        logger.info("node in a state we don't resume from", state=node.state,
                    flags=sorted(node.flags))
        return
    if not reasons.owned_by(node.reason, adapter.prefix, STEP, list(ours.reasons)):
        logger.info("drain reason not the health gate's; not resuming", reason=node.reason)
        return
    try:
        if adapter.resume(ctx.node):
            logger.warning("node healthy again: resumed", passes=ours.streak,
                           previous_reason=node.reason)
            _bookkeeping(ctx, "record that our drain is over", lambda: _forget_drain(ctx), None)
    except ForeignDrain as exc:
        logger.info("drain changed hands before resume; left alone", error=str(exc))


def _release_held(ctx: HookContext, failed_jobs: list[int]) -> None:
    """Release jobs our failed prolog got requeued *held* (no nohold_on_prolog_fail)."""
    logger = log.get_logger("health", hook=ctx.kind)
    keep: list[int] = []
    for job_id in failed_jobs:
        try:
            job = ctx.adapter.show_job(job_id)
        except JobNotFound:
            continue
        except SlurmError as exc:
            logger.warning("couldn't read a job our prolog failed", job_id=job_id,
                           error=str(exc))
            keep.append(job_id)
            continue
        reason = job.reason.replace("_", " ").lower()
        if job.state == "PENDING" and reason == _HELD_REASON:
            try:
                ctx.adapter.release(job_id)
                logger.warning("released job held after our prolog failed", job_id=job_id)
                # Slurm requeued it held, we let it go: a requeue (counted once, here).
                events.count(ctx.adapter.events_path, events.REQUEUE, "prolog")
            except SlurmError as exc:
                logger.warning("couldn't release held job", job_id=job_id, error=str(exc))
                keep.append(job_id)
        elif job.restarts > 0 and job.state not in JOB_FINAL_STATES:
            # Requeued without a hold (nohold_on_prolog_fail), or on its way back
            # (REQUEUED, COMPLETING): a requeue all the same.
            events.count(ctx.adapter.events_path, events.REQUEUE, "prolog")
        elif job.state not in JOB_FINAL_STATES:
            # Not requeued yet (slurmctld may still be taking it off the node, seen as
            # REQUEUED, COMPLETING or CONFIGURING): look again next run. Dropping it here
            # lost the requeue whenever a health-check pass came in that window.
            keep.append(job_id)
        else:
            logger.info("job our prolog failed ended without a requeue", job_id=job_id,
                        state=job.state)
    _bookkeeping(ctx, "record the jobs still held", lambda: _keep_failed(ctx, keep), None)


def _keep_failed(ctx: HookContext, keep: list[int]) -> None:
    store = _store(ctx)
    fd = store.lock()
    try:
        current = store.load_state(OURS, DrainMemory)
        store.save(OURS, dataclasses.replace(current, failed_jobs=tuple(keep)).to_json())
    finally:
        os.close(fd)
