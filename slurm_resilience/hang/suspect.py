"""Suspect nodes: verified on their own agent, then returned to service or drained.

An incident that blames a node by heuristics only drains it with a ``suspect`` reason. The
node's own agent sees that reason (it polls its node's state often for a while after taking
part in an incident, and rarely otherwise), waits until the hung job has left the node, and
verifies it: the health gate's checks, then the loopback all-reduce test of idle verification
(``slurm_resilience.nccl``), under the node lock. A job under ``launch`` keeps the node in
its allocation after a relaunch took it out of the step: once the job runs nothing there
(no other job, none of its steps), the node is verified at once, and a pass returns it to
the job as a spare; a failure then drains nothing and waits for the job to leave. Then:

* a failed check drains the node with a reason naming it (measured against expected);
* suspicion from jobs of ``suspect_threshold`` different users within ``suspect_window_s``
  is no evidence (any user's job can stall a rank by sleeping): it runs a deeper
  verification (:func:`deep_verify`: the active diagnostics, which hold the memory test, and
  a longer loopback test), drains only if that fails, and else returns the node and reports
  the repeated suspicion (log, ``status``, the ``node_suspicion_users`` metric);
* otherwise it is resumed, only if the suspect reason is still the one it verified.

Bound on return to service: the poll interval, plus the wait for the job to leave, plus
the gate (``health.collector_timeout_s``) and the loopback test (``nccl.timeout_s`` per
attempt, ``nccl.retries`` + 1 attempts); for a repeated suspect plus the diagnostics
(``health.diag.timeout_s``) and the longer test (:data:`DEEP_LOOPBACK_FACTOR` times
``nccl.timeout_s`` per attempt).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

from slurm_resilience import events, safefs
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.hang import policy
from slurm_resilience.hang.incidentrecords import Clock
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import ForeignDrain, SlurmError
from slurm_resilience.slurm.parse import NodeInfo
from slurm_resilience.slurm.reasons import cause_of

if TYPE_CHECKING:
    from slurm_resilience.config.heartbeat import HeartbeatSection
    from slurm_resilience.config.nccl import NcclSection

log = get_logger("heartbeat.suspect")

MAX_HISTORY = 256
# The deeper verification's loopback test: this many times the iterations per size, and the
# per-attempt limit (at most an hour), of the nccl section.
DEEP_LOOPBACK_FACTOR = 4
HISTORY_FILE = "suspicions.json"
DEEP_FILE = "suspicion-verified.json"
# Each wait between looks is drawn from [1 - JITTER, 1 + JITTER] times the interval, so the
# agents of one incident, which all start polling at once, don't reach slurmctld in step.
JITTER = 0.2
# A suspect its job still holds (a relaunch's spare-to-be) that fails its verification is
# verified again after HELD_RETRY_S, then twice that, HELD_RETRIES times in all: a check
# that failed once for a passing cause (a user's step still leaving the node) need not
# keep a good spare out of the job until it ends. After that, once the job has left.
HELD_RETRIES = 2
HELD_RETRY_S = 60.0


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    # Could not run now (the node lock is held by another test): verify again later.
    retry: bool = False


@dataclass(frozen=True)
class Verification:
    checks: tuple[Check, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def retry(self) -> bool:
        return any(c.retry for c in self.checks)

    @property
    def failure(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)


def health_check(cfg: Config, node: str) -> Check:
    """The gate's active checks now (as a health run would)."""
    from slurm_resilience.health import gate

    report = gate.run(cfg, node, "healthcheck")
    if report.verdict.healthy:
        return Check("health gate", True, f"{len(report.findings)} findings, none blocking")
    return Check("health gate", False, report.verdict.reason())


def _wrong_detail(result: Any) -> str:
    """Measured against expected for a wrong all-reduce: elements that differ from the sum."""
    for variant in result.variants:
        for attempt in reversed(variant.attempts):
            for rank in attempt.ranks:
                for r in rank.report.get("results", ()):
                    bad = int(r.get("mismatches", 0))
                    if bad:
                        count = int(r.get("size", 0)) // 4
                        return f"{bad} of {count} elements differ from the expected sum"
    return ""


def _lock(cfg: Config, node: str) -> Any:
    from slurm_resilience.nccl import schedule

    return schedule.NodeLock(os.path.join(node_path(cfg.node.run_dir, node),
                                          schedule.LOCK_NAME))


def _loopback(cfg: Config, node: str, section: NcclSection, name: str,
              stop: threading.Event | None = None) -> Check:
    """One loopback all-reduce test with ``section`` (the caller holds the node lock)."""
    from slurm_resilience.nccl import gate

    fault = node_path(cfg.nccl.fault_file, node) if cfg.nccl.fault_file else ""
    result = gate.run_gate(section, fault_file=fault, nice=0, stop=stop)
    reasons = "; ".join(result.reasons)
    if result.verdict == "pass":
        return Check(name, True, reasons)
    if result.verdict == "fail":
        extra = _wrong_detail(result)
        return Check(name, False, f"{reasons}: {extra}" if extra else reasons)
    # "unknown": the test could not run here (no GPUs seen, no torch); not evidence against the
    # node, so not a failure, but said in the log and the node's verification record.
    return Check(name, True, f"not verified ({result.verdict}): {reasons}")


def loopback_check(cfg: Config, node: str, *, stop: threading.Event | None = None) -> Check:
    """The loopback all-reduce test of the nccl section, holding the node lock."""
    lock = _lock(cfg, node)
    if not lock.try_acquire():
        return Check("loopback test", False, "node lock busy (another test or a job): not run",
                     retry=True)
    try:
        return _loopback(cfg, node, cfg.nccl, "loopback test", stop)
    finally:
        lock.release()


def diag_check(cfg: Config, node: str) -> Check:
    """The active diagnostics now: ``dcgmi diag`` where installed, else the torch memory and
    bandwidth test (the caller holds the node lock, as idle diagnostics do)."""
    from slurm_resilience.health import gate
    from slurm_resilience.health.findings import Severity

    report = gate.run(cfg, node, "healthcheck", only=("diag",))
    if not report.verdict.healthy:
        return Check("active diagnostics", False, report.verdict.reason())
    unknown = [f.message for f in report.findings if f.severity is Severity.UNKNOWN]
    if unknown:  # no tool here: no evidence either way, said (as the loopback test's unknown)
        return Check("active diagnostics", True, f"not verified: {'; '.join(unknown)}")
    return Check("active diagnostics", True, f"{len(report.findings)} findings, none blocking")


Verifier = Callable[[Config, str], Verification]


def verify(cfg: Config, node: str) -> Verification:
    """Health gate, then (when configured and the gate passed) the loopback test."""
    started = time.monotonic()
    try:
        checks = [health_check(cfg, node)]
    except Exception as exc:  # noqa: BLE001 - a broken gate is a failed verification
        checks = [Check("health gate", False, f"couldn't run: {exc}")]
    if checks[0].ok and cfg.heartbeat.verify_loopback:
        try:
            checks.append(loopback_check(cfg, node))
        except Exception as exc:  # noqa: BLE001 - same: the node is not shown healthy
            checks.append(Check("loopback test", False, f"couldn't run: {exc}"))
    return Verification(tuple(checks), time.monotonic() - started)


def deep_verify(cfg: Config, node: str) -> Verification:
    """Deeper verification of a node suspected by several users' jobs, after :func:`verify`
    passed: under the node lock, the active diagnostics (``health.diag``; they hold the
    memory test) and the loopback test with :data:`DEEP_LOOPBACK_FACTOR` times the
    iterations (``heartbeat.verify_loopback``). A busy lock postpones it; a crash fails it."""
    started = time.monotonic()
    lock = _lock(cfg, node)
    if not lock.try_acquire():
        return Verification((Check("deeper verification", False, "node lock busy (another "
                                   "test or a job): not run", retry=True),), 0.0)
    checks: list[Check] = []
    try:
        if cfg.health.diag.enabled:
            try:
                checks.append(diag_check(cfg, node))
            except Exception as exc:  # noqa: BLE001 - a broken check is a failed verification
                checks.append(Check("active diagnostics", False, f"couldn't run: {exc}"))
        if cfg.heartbeat.verify_loopback and all(c.ok for c in checks):
            s = cfg.nccl
            longer = replace(s, iters=min(10000, s.iters * DEEP_LOOPBACK_FACTOR),
                             timeout_s=min(3600.0, s.timeout_s * DEEP_LOOPBACK_FACTOR))
            try:
                checks.append(_loopback(cfg, node, longer, "longer loopback test"))
            except Exception as exc:  # noqa: BLE001 - same: the node is not shown healthy
                checks.append(Check("longer loopback test", False, f"couldn't run: {exc}"))
    finally:
        lock.release()
    if not checks:
        checks.append(Check("deeper verification", True, "nothing more to run (health.diag "
                            "and heartbeat.verify_loopback are off)"))
    return Verification(tuple(checks), time.monotonic() - started)


class DeepDoc(TypedDict):
    """The last deeper verification of this node (``status`` shows it)."""

    at: float
    jobs: list[list[Any]]  # [job_id, user] of the suspicions that led to it
    users: int
    passed: bool
    checks: list[str]
    outcome: str


class SuspectHistory:
    """Suspicions of this node (job, user, time), kept in the agent's state dir."""

    def __init__(self, path: str):
        self.path = path

    def load(self) -> list[tuple[float, int, str]]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            return [(float(a), int(j), str(u)) for a, j, u in data][-MAX_HISTORY:]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as exc:
            log.warning("heartbeat: suspect: couldn't read suspicion history", path=self.path,
                        error=str(exc))
            return []

    def add(self, at: float, job_id: int, user: str) -> list[tuple[float, int, str]]:
        items = [i for i in self.load() if i[1] != job_id]
        items.append((at, job_id, user))
        items = items[-MAX_HISTORY:]
        fd = safefs.makedirs_root(os.path.dirname(self.path))
        try:
            safefs.replace_file(fd, os.path.basename(self.path), json.dumps(items).encode())
        finally:
            os.close(fd)
        return items


def accumulated(items: list[tuple[float, int, str]], now: float, window_s: float,
                threshold: int) -> list[tuple[int, str]]:
    """Pure: the suspicions within the window when they come from ``threshold`` or more
    different users (else []): what calls for the deeper verification."""
    recent = [(j, u) for at, j, u in items if now - at <= window_s]
    return recent if len({u for _, u in recent}) >= threshold else []


def users_within(items: list[tuple[float, int, str]], now: float, window_s: float) -> int:
    """Pure: how many different users' jobs suspected the node within the window."""
    return len({u for at, _, u in items if now - at <= window_s})


def save_deep(path: str, doc: DeepDoc) -> None:
    fd = safefs.makedirs_root(os.path.dirname(path))
    try:
        safefs.replace_file(fd, os.path.basename(path), json.dumps(doc).encode())
    finally:
        os.close(fd)


def load_deep(path: str) -> DeepDoc | None:
    """The last deeper verification, or None when there was none (an unreadable file is
    said in the log and read as none)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return {"at": float(data["at"]), "jobs": [[int(j), str(u)] for j, u in data["jobs"]],
                "users": int(data["users"]), "passed": bool(data["passed"]),
                "checks": [str(c) for c in data["checks"]], "outcome": str(data["outcome"])}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("heartbeat: suspect: couldn't read the last deeper verification",
                    path=path, error=str(exc))
        return None


def poll_interval(hb: HeartbeatSection, job_nodes: int) -> float:
    """Pure: the fast-poll interval after an incident of a job on ``job_nodes`` nodes. Every
    node of the job polls its own state, so the interval grows with the job to keep their
    calls together within ``verify_calls_per_s`` at slurmctld."""
    return max(hb.verify_poll_s, job_nodes / hb.verify_calls_per_s)


def backed_off(interval: float, failures: int, cap: float) -> float:
    """Pure: the interval after ``failures`` failed looks in a row (doubling each time, never
    past ``cap`` unless the interval itself is longer)."""
    return min(interval * 2.0 ** min(failures, 16), max(interval, cap))


@dataclass(frozen=True)
class HeldFailures:
    """Failed verifications while ``job`` held the node: how many, and when to try again
    (monotonic)."""

    job: int
    count: int
    next_at: float


class SuspectWatch:
    """Polls this node's Slurm state for a suspect drain and verifies the node."""

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter, clock: Clock,
                 state_dir: str, verifier: Verifier = verify,
                 deep_verifier: Verifier = deep_verify, rng: random.Random | None = None):
        self.cfg = cfg
        self.node = node
        self.adapter = adapter
        self.clock = clock
        self.verifier = verifier
        self.deep_verifier = deep_verifier
        self.history = SuspectHistory(os.path.join(state_dir, HISTORY_FILE))
        self.deep_path = os.path.join(state_dir, DEEP_FILE)
        self.next_poll = 0.0  # monotonic; 0: at the first tick (agent start)
        self.busy_until = -1.0  # monotonic end of the fast-poll window
        self.fast_poll_s = cfg.heartbeat.verify_poll_s  # set per incident (its job's size)
        self.failures = 0  # looks at the node's state that failed in a row (backoff)
        self.held_failures: HeldFailures | None = None  # while its job holds the node
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not a secret
        self.thread: threading.Thread | None = None
        self.last: dict[str, Any] = {}

    def incident_seen(self, job_nodes: int = 1) -> None:
        """This node took part in an incident of a job on ``job_nodes`` nodes: poll often
        for a while (see :func:`poll_interval`)."""
        now = self.clock.monotonic()
        hb = self.cfg.heartbeat
        if now >= self.busy_until:
            self.fast_poll_s = poll_interval(hb, job_nodes)
        else:  # overlapping incidents: the larger job sets the pace
            self.fast_poll_s = max(self.fast_poll_s, poll_interval(hb, job_nodes))
        self.busy_until = now + hb.verify_window_s
        # The first look anywhere within one interval: every node of the job starts now, and
        # their looks spread evenly from the first one.
        self.next_poll = min(self.next_poll, now + self.fast_poll_s * self.rng.random())

    def _jittered(self, interval: float) -> float:
        return interval * self.rng.uniform(1.0 - JITTER, 1.0 + JITTER)

    def _wait(self, now: float) -> float:
        """Until the next look: fast in the window after an incident, else idle; longer
        after failed looks."""
        hb = self.cfg.heartbeat
        base = self.fast_poll_s if now < self.busy_until else hb.verify_idle_poll_s
        return self._jittered(backed_off(base, self.failures, hb.verify_idle_poll_s))

    def due(self) -> bool:
        """Whether a look is due now (and none running); schedules the one after it."""
        now = self.clock.monotonic()
        if now < self.next_poll or (self.thread is not None and self.thread.is_alive()):
            return False
        self.next_poll = now + self._wait(now)
        return True

    def tick(self) -> None:
        """Start a poll when one is due; the Slurm call and any verification run in the
        watch's own thread (slurmctld may be slow or away: the agent's tick must not wait)."""
        if not self.due():
            return
        self.thread = threading.Thread(target=self._poll_safely, name=f"verify-{self.node}",
                                       daemon=True)
        self.thread.start()

    def _poll_safely(self) -> None:
        try:
            self.poll()
        except Exception:
            log.exception("heartbeat: suspect: verification failed to run", node=self.node)

    def poll(self) -> str:
        """Look at this node's state; verify it when it is a suspect the job has left."""
        hb = self.cfg.heartbeat
        try:
            info = self.adapter.show_node(self.node)
        except SlurmError as exc:
            self.failures += 1
            now = self.clock.monotonic()
            self.next_poll = now + self._wait(now)
            log.warning("heartbeat: suspect: couldn't read node state; looking again later",
                        error=str(exc), failures=self.failures,
                        next_in_s=round(self.next_poll - now, 1))
            return "couldn't read node state"
        self.failures = 0
        ours_out = (info.drained or info.down) and self.adapter.ours(info.reason)
        events.observe_drain(self.adapter.events_path, self.node,
                             cause_of(info.reason, self.adapter.prefix) if ours_out
                             else None, self.clock.time())
        parsed = policy.parse_reason(info.reason) if info.drained else None
        if parsed is None or not parsed.suspect or not self.adapter.ours(info.reason):
            return "not a suspect"
        held = info.alloc_cpus > 0
        if "COMPLETING" in info.flags or (held and not self._held_idle(parsed)):
            # The hung job is still leaving (or another job was already placed): look again
            # soon. A requeued job frees its CPUs at once but its processes stay until they
            # exit or KillWait ends them (COMPLETING): verifying then would test a node still
            # running them, and return it before its drain was ever complete.
            self.next_poll = self.clock.monotonic() + self._jittered(hb.verify_poll_s)
            return "suspect still allocated"
        return self.handle(info, parsed, held=held)

    def _held_idle(self, parsed: policy.HangReason) -> bool:
        """The suspect's own job still holds the node but runs nothing on it: a relaunch
        under ``launch`` took it out of the step, and the job keeps its allocation. It is
        verified now, so that it can return to the job as a spare (launch/returning.py)
        rather than wait for the job's end. After a failure, again only once the backoff has
        passed, and not after HELD_RETRIES more."""
        job = parsed.job_id
        if job is None:
            return False
        failed = self.held_failures
        if failed is not None and failed.job == job and (
                failed.count > HELD_RETRIES or self.clock.monotonic() < failed.next_at):
            return False
        try:
            use = self.adapter.node_in_use(self.node, job)
        except SlurmError as exc:
            log.info("heartbeat: suspect: couldn't read what runs on the node; verifying "
                     "once the job has left it", node=self.node, job_id=job, error=str(exc))
            return False
        if use:
            return False
        log.info("heartbeat: suspect: the job holds the node but runs nothing on it: "
                 "verifying it now", node=self.node, job_id=job)
        return True

    def handle(self, info: NodeInfo, parsed: policy.HangReason, *, held: bool = False) -> str:
        """Verify (deeper when several users' jobs suspected the node), then drain the node
        on a failed check or return it; returns what was done. ``held``: the suspect's job
        still holds the node (see :meth:`_held_idle`), so only a pass counts now: a failure
        is verified again later, and finally once the job has left (a step the user
        started there meanwhile could have failed it, and a user must not drain a node)."""
        hb = self.cfg.heartbeat
        job = parsed.job_id if parsed.job_id is not None else -1
        log.warning("heartbeat: suspect: verifying node", job_id=job, reason=info.reason,
                    held_by_job=held)
        result = self.verifier(self.cfg, self.node)
        if result.retry:
            return self._postpone(result)
        if held and not result.passed:
            return self._failed_while_held(job, result)
        now = self.clock.time()
        # A reason naming no job (an earlier release's "suspect of jobs") adds no suspicion.
        items = (self.history.add(now, job, parsed.user) if parsed.job_id is not None
                 else self.history.load())
        many = accumulated(items, now, hb.suspect_window_s, hb.suspect_threshold)
        deep: Verification | None = None
        if result.passed and many:
            log.warning("heartbeat: suspect: suspected by several users' jobs: deeper "
                        "verification", node=self.node, users=len({u for _, u in many}),
                        jobs=[f"{j}({u})" for j, u in many])
            deep = self.deep_verifier(self.cfg, self.node)
            if deep.retry:
                return self._postpone(deep)
            if held and not deep.passed:
                return self._failed_while_held(job, deep)
        if not result.passed:
            outcome = self._drain(policy.drain_reason(
                job, parsed.user, now, f"verification failed: {result.failure}"))
        elif deep is not None and not deep.passed:
            outcome = self._drain(policy.drain_reason(
                job, parsed.user, now, f"deeper verification failed: {deep.failure}"))
        else:
            outcome = self._resume(info.reason)
        checks = [*result.checks, *(deep.checks if deep is not None else ())]
        seconds = result.seconds + (deep.seconds if deep is not None else 0.0)
        if deep is not None:
            self._report_repeated(many, deep, now, outcome)
        self.last = {"job_id": job, "checks": [c.__dict__ for c in checks],
                     "seconds": round(seconds, 3), "outcome": outcome, "at": now}
        log.warning("heartbeat: suspect: verified", node=self.node, job_id=job,
                    passed=result.passed and (deep is None or deep.passed),
                    checks=[f"{c.name}: {c.detail}" for c in checks],
                    seconds=round(seconds, 3), outcome=outcome)
        return outcome

    def _failed_while_held(self, job: int, result: Verification) -> str:
        before = self.held_failures
        count = before.count + 1 if before is not None and before.job == job else 1
        wait = HELD_RETRY_S * 2 ** (count - 1)
        self.held_failures = HeldFailures(job, count, self.clock.monotonic() + wait)
        checks = [f"{c.name}: {c.detail}" for c in result.checks]
        if count > HELD_RETRIES:
            log.warning("heartbeat: suspect: verification failed while the job still holds "
                        "the node: verifying again once it has left", node=self.node,
                        job_id=job, failures=count, checks=checks)
            return "verification failed while held: again once the job has left"
        log.warning("heartbeat: suspect: verification failed while the job still holds the "
                    "node: verifying again later", node=self.node, job_id=job,
                    failures=count, next_in_s=wait, checks=checks)
        return f"verification failed while held: again in {wait:.0f} s"

    def _postpone(self, result: Verification) -> str:
        self.next_poll = self.clock.monotonic() + self.cfg.heartbeat.verify_poll_s
        log.info("heartbeat: suspect: verification could not run now; again soon",
                 node=self.node, checks=[f"{c.name}: {c.detail}" for c in result.checks])
        return "verification postponed"

    def _report_repeated(self, many: list[tuple[int, str]], deep: Verification, now: float,
                         outcome: str) -> None:
        """For operators: the log, the record ``status`` shows, and a counted event."""
        users = len({u for _, u in many})
        hours = self.cfg.heartbeat.suspect_window_s / 3600
        doc: DeepDoc = {"at": now, "jobs": [[j, u] for j, u in many], "users": users,
                        "passed": deep.passed,
                        "checks": [f"{c.name}: {c.detail}" for c in deep.checks],
                        "outcome": outcome}
        try:
            save_deep(self.deep_path, doc)
        except OSError as exc:
            log.warning("heartbeat: suspect: couldn't record the deeper verification",
                        path=self.deep_path, error=str(exc))
        events.count(self.adapter.events_path, events.SUSPICION,
                     "cleared" if deep.passed else "failed")
        log.warning(f"heartbeat: suspect: node suspected by {users} users' jobs within "
                    f"{hours:g}h; deeper verification "
                    + ("passed: not drained (suspicion is no evidence)" if deep.passed
                       else "failed"), node=self.node, jobs=[f"{j}({u})" for j, u in many],
                    checks=doc["checks"], outcome=outcome)

    def recent_users(self) -> int:
        """Users whose jobs suspected this node within ``suspect_window_s`` (the metric)."""
        return users_within(self.history.load(), self.clock.time(),
                            self.cfg.heartbeat.suspect_window_s)

    def _drain(self, reason: str) -> str:
        try:
            return f"drained: {self.adapter.drain(self.node, reason)}"
        except ForeignDrain as exc:
            return f"left alone: {exc.slurm_message}"
        except SlurmError as exc:
            self.next_poll = self.clock.monotonic() + self.cfg.heartbeat.verify_poll_s
            return f"couldn't drain: {exc}"

    def _resume(self, verified_reason: str) -> str:
        try:
            now_info = self.adapter.show_node(self.node)
            if now_info.reason != verified_reason:
                return f"not resumed: reason changed to {now_info.reason!r} meanwhile"
            self.adapter.resume(self.node)
            return "returned to service"
        except ForeignDrain as exc:
            return f"not resumed: {exc.slurm_message}"
        except SlurmError as exc:
            self.next_poll = self.clock.monotonic() + self.cfg.heartbeat.verify_poll_s
            return f"couldn't resume: {exc}"

    def close(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
