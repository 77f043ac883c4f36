"""A job killed by a node fault restarts by itself, away from the node.

The epilog's gate looks at the node after every job (the Xids raised while it ran, the
GPUs, the other checks). When it finds a fault that drains the node and the job ended
non-zero, the fault most likely killed the job: a GPU that fell off the bus makes the
CUDA calls of its process fail. Such a job is requeued when it asked to be
(``--requeue``), with the node in its excluded list; the drain keeps the node out for
every other job. A job that failed on a node the gate finds healthy failed for its own
reasons and is left alone (every node's epilog decides for itself: only a node with a
fault acts).

Restarts of this kind have a cap of their own (``health.fault_requeue_max``), kept in the
job's AdminComment beside the hang count as ``[sr-fault n=1 restart=0]``: users can't set
AdminComment, slurmctld keeps it across requeues, and ``restart`` (the job's Restarts when
we acted) makes a second faulty node of the same run, or a rerun of the epilog, a no-op.
They never count against the hang requeue cap, and the metrics count them as requeues
with cause ``node_fault``.

Slurm 22.05 lets root requeue a job while its epilogs still run (state COMPLETING); the
job is requeued held, its exclusions set, then released, so it can't be started on the
faulty node in between (the same order the hang path uses).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import JobInfo

_TOKEN = re.compile(r"\[sr-fault n=(\d+) restart=(\d+)\]")
_OURS = re.compile(r"node fault on [^|]*(\||$)")
CAUSE = "node_fault"


@dataclass(frozen=True)
class FaultLedger:
    """Node-fault requeues of a job so far, and its Restarts when the last one was made."""

    requeues: int = 0
    restart: int = -1

    def token(self) -> str:
        return f"[sr-fault n={self.requeues} restart={self.restart}]"


def parse_ledger(admin_comment: str) -> FaultLedger:
    m = _TOKEN.search(admin_comment)
    return FaultLedger(int(m.group(1)), int(m.group(2))) if m else FaultLedger()


def merge_comment(admin_comment: str, ledger: FaultLedger, text: str) -> str:
    """The AdminComment with our token and text replaced, everything else kept."""
    rest = _OURS.sub("", _TOKEN.sub("", admin_comment))
    rest = re.sub(r"^\s*SR:\s*", "", rest).strip(" |")
    ours = f"{ledger.token()} {text}"
    return f"{ours} | {rest}" if rest else ours


def exit_status(env_value: str) -> int | None:
    """The job's exit code from the epilog's ``SLURM_JOB_EXIT_CODE2`` (``code:signal``):
    non-zero when either part is; None when absent or not in that form."""
    m = re.fullmatch(r"(\d+):(\d+)", env_value.strip())
    if not m:
        return None
    code, signal = int(m.group(1)), int(m.group(2))
    return code or (128 + signal if signal else 0)


@dataclass(frozen=True)
class Decision:
    action: str  # requeue | leave | skip
    reason: str
    ledger: FaultLedger


def decide(job: JobInfo, *, exit_code: int | None, cap: int) -> Decision:
    """Pure: what to do with ``job`` whose node had a fault during it."""
    ledger = parse_ledger(job.admin_comment)
    jid = job.job_id
    state = job.state.split("+")[0].split()[0] if job.state else ""
    if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return Decision("skip", f"job {jid} is already back in the queue", ledger)
    if ledger.restart == job.restarts:
        return Decision("skip", f"job {jid}: run {job.restarts} was already requeued after a "
                                "node fault", ledger)
    if exit_code is None:
        return Decision("leave", f"job {jid}: its exit code is unknown; not requeued", ledger)
    if exit_code == 0:
        return Decision("leave", f"job {jid} ended well; not requeued", ledger)
    if state in ("CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE", "OUT_OF_MEMORY"):
        return Decision("leave", f"job {jid} ended {state}, not by the fault; not requeued",
                        ledger)
    if not job.requeue:
        return Decision("leave", f"job {jid} is not requeueable (--no-requeue); not "
                                 "requeued", ledger)
    if ledger.requeues >= cap:
        return Decision("leave", f"job {jid}: {ledger.requeues} node-fault requeues already "
                                 f"(cap {cap}); not requeued", ledger)
    return Decision("requeue", f"job {jid}: node-fault requeue {ledger.requeues + 1} of {cap}",
                    FaultLedger(ledger.requeues + 1, job.restarts))


def after_fault(ctx: HookContext, fault: str) -> None:
    """The epilog found ``fault`` on this node: requeue the job away from it when it ended
    non-zero because of it (see :func:`decide`). Errors are logged, never raised: the drain
    that follows must happen whatever Slurm answers here."""
    cap = ctx.cfg.health.fault_requeue_max
    if ctx.job_id is None or cap <= 0 or ctx.kind != "epilog":
        return
    logger = get_logger("health", hook=ctx.kind)
    adapter = ctx.adapter
    try:
        job = adapter.show_job(ctx.job_id)
    except SlurmError as exc:
        logger.error("node fault: couldn't read the job; not requeued", error=str(exc))
        return
    code = exit_status(ctx.env.get("SLURM_JOB_EXIT_CODE2", ""))
    d = decide(job, exit_code=code, cap=cap)
    logger.warning(f"node fault: {d.reason}", action=d.action, fault=fault,
                   exit_code=code, restarts=job.restarts)
    if d.action != "requeue":
        return
    done, what = requeue_away(adapter, job, d.ledger, [ctx.node],
                              f"node fault on {ctx.node}: {fault}")
    if not done:
        logger.error(f"node fault: {what}")


# slurmctld's answers that mean "not now": right after a requeue, Slurm refuses updates of
# the job until its new accounting record is set up ("Job update not available right now,
# the DB index is being set, try again in a bit"), and a busy or restarting slurmctld
# doesn't answer. The updates after the requeue are tried again for about 15 s.
_TRANSIENT = re.compile(r"try again|unable to contact|connection refused|timed out|"
                        r"zero bytes", re.IGNORECASE)
RETRY_PAUSES_S = (0.5, 1.0, 2.0, 4.0, 4.0, 4.0)


def _retried(what: str, job_id: int, call: Callable[[], object], clock: Clock) -> None:
    for pause in (*RETRY_PAUSES_S, None):
        try:
            call()
            return
        except SlurmError as exc:
            if pause is None or not _TRANSIENT.search(str(exc)):
                raise
            get_logger("health").warning(
                "fault requeue: Slurm said not now; trying again", what=what, job_id=job_id,
                retry_in_s=pause, error=str(exc))
            clock.sleep(pause)


def requeue_away(adapter: SlurmAdapter, job: JobInfo, ledger: FaultLedger,
                 nodes: Sequence[str], text: str, clock: Clock | None = None,
                 before_release: Callable[[int], object] | None = None
                 ) -> tuple[bool, str]:
    """Requeue ``job`` held, record ``ledger`` and ``text`` in its AdminComment, add
    ``nodes`` to its excluded list, release it: (whether it is back in the queue, released,
    and what happened). Held first so that it can't start on those nodes in between, nor
    before ``before_release(job_id)`` (bounded by its own wait) has returned."""
    clock = clock or SystemClock()
    try:
        adapter.requeue_hold(job.job_id, cause=CAUSE, released=True)
    except SlurmError as exc:
        return False, f"couldn't requeue the job: {exc}"
    try:
        comment = merge_comment(job.admin_comment, ledger, text)
        _retried("record the requeue", job.job_id,
                 lambda: adapter.set_admin_comment(job.job_id, comment), clock)
        _retried(f"exclude {','.join(nodes)}", job.job_id,
                 lambda: adapter.exclude_nodes(job.job_id, list(nodes)), clock)
    except SlurmError as exc:
        # Without the count the cap can't hold, without the exclusion the job may land on
        # the node again: it stays held for an operator, and says why.
        return False, ("the job is requeued but held: couldn't record the requeue or "
                       f"exclude {','.join(nodes)} (release it with scontrol release): {exc}")
    if before_release is not None:
        before_release(job.job_id)
    try:
        _retried("release the job", job.job_id, lambda: adapter.release(job.job_id), clock)
    except SlurmError as exc:
        return False, f"couldn't release the requeued job; it stays held: {exc}"
    return True, f"requeued job {job.job_id} excluding {','.join(nodes)}"
