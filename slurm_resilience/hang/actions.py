"""Acting on a decision: a plan of Slurm steps run in order, each retried with backoff while
Slurm fails, until the incident's deadline. Progress is reported after every step so the
plan can be persisted and resumed by a restarted agent.

Steps that must not happen twice check Slurm first: a requeue is done when the job's
Restarts moved past the run (or it is no longer running), a release when the job is no
longer held.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from slurm_resilience.clock import Clock
from slurm_resilience.hang import takeouts as T
from slurm_resilience.heartbeat.attempt import restarts_of
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import (
    ForeignDrain,
    JobNotFound,
    JobUpdateRefused,
    NodeNotFound,
    SlurmError,
    SlurmTimeout,
)

log = get_logger("heartbeat.actions")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


class StepKind(enum.Enum):
    DRAIN = "drain"  # node, reason
    RECORD = "record"  # node, the drain's reason: noted in the node's Comment (budgets)
    COMMENT = "comment"  # AdminComment text
    REQUEUE = "requeue"
    REQUEUE_HOLD = "requeue-hold"  # text: AdminComment
    EXCLUDE = "exclude"  # nodes
    RELEASE = "release"
    CANCEL = "cancel"
    RELAUNCH = "relaunch"  # target: the relaunch number, nodes: the step's, text: the order


class StepDoc(TypedDict):
    kind: str  # a StepKind's value
    target: str
    text: str
    nodes: list[str]


@dataclass(frozen=True)
class Step:
    kind: StepKind
    target: str = ""
    text: str = ""
    nodes: tuple[str, ...] = ()

    def to_json(self) -> StepDoc:
        return {"kind": self.kind.value, "target": self.target, "text": self.text,
                "nodes": list(self.nodes)}

    def describe(self, job_id: int) -> str:
        if self.kind is StepKind.DRAIN:
            return f"drain {self.target}"
        if self.kind is StepKind.RECORD:
            return f"record the take-out of {self.target}"
        if self.kind is StepKind.EXCLUDE:
            return f"exclude {','.join(self.nodes)} from job {job_id}"
        if self.kind is StepKind.RELAUNCH:
            return f"relaunch job {job_id}'s step on {','.join(self.nodes)}"
        return f"{self.kind.value} job {job_id}"


def step_from_json(data: object) -> Step:
    if not isinstance(data, dict):
        raise ValueError("step is not an object")
    return Step(StepKind(data["kind"]), str(data.get("target", "")), str(data.get("text", "")),
                tuple(str(n) for n in data.get("nodes", [])))


class Clocked:
    """The retry loop's clock (its wall time), its wait between tries and its stop flag.
    The agent's wait is its stop event's, so that stopping ends it at once; without one
    the clock's sleep waits."""

    def __init__(self, clock: Clock, sleep: Callable[[float], object] | None = None,
                 stopping: Callable[[], bool] = lambda: False):
        self.clock = clock
        self.sleep = sleep or clock.sleep
        self.stopping = stopping

    def now(self) -> float:
        return self.clock.time()


class DeadlinePassed(Exception):
    """Slurm kept failing until the incident's deadline."""


class Stopping(Exception):
    """The agent is stopping: the incident is left as persisted, for the next start."""


def retry(what: str, call: Callable[[], Any], deadline: float, clock: Clocked) -> Any:
    """``call()`` until it does not raise SlurmError (other than a definite answer such as a
    job or node not found, or a foreign drain), backing off, until ``deadline``."""
    delay = BACKOFF_FIRST_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except (ForeignDrain, JobNotFound, NodeNotFound):
            raise
        except SlurmError as exc:
            if clock.stopping():
                raise Stopping(f"agent stopping while trying to {what}") from exc
            left = deadline - clock.now()
            if left <= 0:
                raise DeadlinePassed(f"couldn't {what}: {exc} (gave up at the incident's "
                                     f"deadline after {attempt} attempts)") from exc
            log.warning("heartbeat: act: couldn't reach Slurm; retrying", what=what,
                        attempt=attempt, retry_in_s=round(min(delay, left), 2), error=str(exc))
            clock.sleep(min(delay, left))
            if clock.stopping():
                raise Stopping(f"agent stopping while trying to {what}") from exc
            delay = min(delay * 2, BACKOFF_MAX_S)


def _held(reason: str) -> bool:
    # Our own (admin) hold; a hold the user set is theirs to release.
    return "held" in reason.lower() and reason != "JobHeldUser"


# Hands a RELAUNCH step to the job's launcher; what was done.
Relauncher = Callable[[Step], str]


def run_step(adapter: SlurmAdapter, job_id: int, run: int, step: Step, *,
             released: bool = False, relaunch: Relauncher | None = None) -> str:
    """One step, once; returns what was done (raises SlurmError to be retried).
    ``released``: the plan releases the job after its requeue-hold (a requeue).
    ``run``: the incident's attempt (:mod:`attempt`)."""
    k = step.kind
    if k is StepKind.RELAUNCH:
        if relaunch is None:
            raise ValueError("a relaunch step needs the agent's launcher registry")
        return relaunch(step)
    if k is StepKind.DRAIN:
        try:
            return f"drained {step.target}: {adapter.drain(step.target, step.text)}"
        except ForeignDrain as exc:
            return f"left {step.target} alone: {exc.slurm_message}"
    if k is StepKind.RECORD:
        return record_takeout(adapter, step.target, step.text)
    if k is StepKind.COMMENT:
        adapter.set_admin_comment(job_id, step.text)
        return f"set the AdminComment of job {job_id}"
    if k in (StepKind.REQUEUE, StepKind.REQUEUE_HOLD, StepKind.CANCEL):
        job = adapter.show_job(job_id)
        if job.restarts != restarts_of(run) or job.state not in ("RUNNING", "SUSPENDED",
                                                                 "CONFIGURING"):
            return (f"job {job_id} is {job.state} with Restarts={job.restarts}: run "
                    f"{restarts_of(run)} already ended, no {k.value}")
        if k is StepKind.REQUEUE:
            adapter.requeue(job_id)
            return f"requeued job {job_id}"
        if k is StepKind.CANCEL:
            adapter.cancel(job_id)
            return f"cancelled job {job_id} (heartbeat.no_requeue_policy: cancel)"
        adapter.requeue_hold(job_id, step.text, released=released)
        return f"requeued and held job {job_id}"
    if k is StepKind.EXCLUDE:
        merged = adapter.exclude_nodes(job_id, step.nodes)
        return f"job {job_id} now excludes {','.join(merged)}"
    if k is StepKind.RELEASE:
        job = adapter.show_job(job_id)
        if not _held(job.reason):
            return f"job {job_id} is not held ({job.reason or job.state}): nothing to release"
        adapter.release(job_id)
        return f"released job {job_id}"
    raise ValueError(f"unknown step {k}")


# scontrol's words when slurmctld can't be reached (worth retrying), as opposed to a refusal.
_UNREACHABLE = re.compile(r"unable to contact|connection refused|connect failure|timed out|"
                          r"zero bytes|try again", re.IGNORECASE)


# Writers of one node's Comment (agents handling different incidents, an operator) race:
# scontrol has no compare-and-set, so each writer reads back its own entry and merges again.
RECORD_TRIES = 3


def record_takeout(adapter: SlurmAdapter, node: str, reason: str) -> str:
    """Note in ``node``'s Comment that hang handling took it out with ``reason``, so the
    hourly budgets keep counting it after a resume (see :mod:`takeouts`). Only a drain Slurm
    shows now is recorded: one left alone (another's drain) takes nothing out. Recording is
    idempotent (a resumed plan repeats it harmlessly) and read back: a concurrent writer
    that replaced the Comment between our read and write is merged with again, up to
    ``RECORD_TRIES`` writes. SlurmError while Slurm is unreachable is raised (retried); a
    refusal is reported and the plan goes on: the take-out then counts only while the node
    stays out."""
    parsed = T.parse_reason(reason)
    if parsed is None:
        return f"no take-out of {node} recorded: {reason!r} is not a hang reason"
    entry = T.TakeOut.of(parsed)
    writes = 0
    try:
        while True:
            info = adapter.show_node(node)
            if not (info.drained or info.down) or T.parse_reason(info.reason) != parsed:
                return f"no take-out of {node} recorded: it is not out for this incident"
            merged = T.merge_comment(info.comment, entry)
            if merged == info.comment:
                break
            if writes == RECORD_TRIES:
                log.error("heartbeat: budget: the node's Comment was replaced under every "
                          "write; take-out not recorded", node=node, writes=writes)
                return (f"couldn't record the take-out of {node}: its Comment was replaced "
                        f"by another writer after each of {writes} writes; the hourly budget "
                        "counts it only while it stays out")
            adapter.set_node_comment(node, merged)
            writes += 1
    except SlurmError as exc:
        if isinstance(exc, (SlurmTimeout, NodeNotFound)) or _UNREACHABLE.search(
                exc.slurm_message):
            raise
        log.error("heartbeat: budget: couldn't record a take-out in the node's Comment",
                  node=node, error=str(exc))
        return (f"couldn't record the take-out of {node} in its Comment ({exc.slurm_message}): "
                "the hourly budget counts it only while it stays out")
    if writes > 1:
        log.warning("heartbeat: budget: the node's Comment changed under our write; merged "
                    "again", node=node, writes=writes)
    return f"recorded the take-out of {node} in its Comment"


# How long a comment Slurm refuses for now (JobUpdateRefused: a job it resized after a lost
# node, for the job's life without accounting) waits before the plan goes on without it.
RESIZED_WAIT_S = 15.0


def _comment(what: str, call: Callable[[], str], deadline: float, clock: Clocked) -> str:
    """A COMMENT step: retried as any step, except that Slurm's refusal to update the job
    ends it after RESIZED_WAIT_S, said, and the plan goes on. The comment carries the hang
    ledger (a requeue's count), but a job left hung for it is worse: before this, a hang
    after a node loss was neither relaunched nor requeued (seen in the fault storm)."""
    try:
        return str(retry(what, call, min(deadline, clock.now() + RESIZED_WAIT_S), clock))
    except DeadlinePassed as exc:
        if not isinstance(exc.__cause__, JobUpdateRefused):
            return str(retry(what, call, deadline, clock))
        log.error("heartbeat: act: Slurm refuses to update the job's AdminComment (a job it "
                  "resized after a lost node); going on without it: the hang ledger of this "
                  "incident is not recorded there", what=what, error=str(exc.__cause__))
        return (f"couldn't {what}: {exc.__cause__} (Slurm refuses updates of a job it "
                "resized until accounting records it); went on without it")


def execute(adapter: SlurmAdapter, job_id: int, run: int, plan: Sequence[Step], done: int,
            deadline: float, clock: Clocked,
            progress: Callable[[int], None],
            relaunch: Relauncher | None = None) -> tuple[list[str], bool]:
    """Run ``plan[done:]``; ``progress(i)`` after each step. Returns (what happened, whether
    every step ran)."""
    actions: list[str] = []
    # mode: observe: the adapter records each step instead of carrying it out; say so.
    said = "not carried out (mode observe): " if adapter.observe else ""
    # A requeue held only while its exclusions are set counts as a requeue.
    released = any(s.kind is StepKind.RELEASE for s in plan)
    for i in range(done, len(plan)):
        step = plan[i]
        try:
            call = functools.partial(run_step, adapter, job_id, run, step, released=released,
                                     relaunch=relaunch)
            if step.kind is StepKind.COMMENT:
                actions.append(said + _comment(step.describe(job_id), call, deadline, clock))
            else:
                actions.append(said + retry(step.describe(job_id), call, deadline, clock))
        except DeadlinePassed as exc:
            actions.append(str(exc))
            return actions, False
        except (JobNotFound, NodeNotFound) as exc:
            actions.append(f"couldn't {step.describe(job_id)}: {exc}")
        progress(i + 1)
    return actions, True
