"""A job's rank died on this node: run the node's HealthCheckProgram now.

A GPU that fell off the bus (Xid 79) or a double-bit ECC error kills the ranks using it at
once, but the gate that finds it and drains the node runs only at the next
HealthCheckInterval (often 5 minutes at sites). Until then the batch host's agent sees a
failed step on nodes Slurm shows in service and can't relaunch it (``nodeloss``: "wait").
So when the watcher sees a rank here go from running to dead (its process gone without
finishing), this node's agent runs the same program slurmd runs, as slurmd runs it (the
program Slurm's configuration names, with ``SLURMD_NODENAME`` and a plain PATH, and
``SLURM_RESILIENCE_AFTER_RANK_DEATH=1``). The gate drains only on evidence about the node,
as always: a rank that died for its own reasons costs one passing health check. Such a run
does not count toward the streak of passes that resumes a drained node, nor start idle
tests (``HookContext.after_rank_death``): a user's dying ranks never bring a node back
sooner.

A job's owner decides when their ranks die, so the runs are bounded: at most one at a
time, and at most one per ``health.check_on_rank_death_s`` (30 s) on this node; 0 turns
this off. A skipped request is not logged (the user decides how many there are).

Cost at 1,024 nodes: a relaunch kills the step's ranks everywhere, so every node runs its
gate once (a served healthcheck takes 0.1-0.3 s in the sandbox). Each run reads its node's
gres from slurmctld when ``health.gpu.expected_count`` is -1 (the default): 1,024 single-
node reads within a second or two, one per node, and a drain from each node that fails.
HealthCheckProgram is read once per agent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from slurm_resilience import proc
from slurm_resilience.clock import Clock
from slurm_resilience.config import Config
from slurm_resilience.hooks.context import ENV_AFTER_RANK_DEATH
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError

log = get_logger("heartbeat", service="death-check")

# slurmd starts HealthCheckProgram with hardly any environment; the same here.
PLAIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# Past the hook's own limit (hooks.healthcheck_timeout_s), for the wrapper's start and exit.
GRACE_S = 10.0


def run_program(argv: Sequence[str], env: dict[str, str], timeout_s: float) -> proc.Completed:
    """The seam: run the program as slurmd would (its own session, killed as a group)."""
    return proc.Runner(env=env).run(argv, timeout=timeout_s, check=False,
                                    group=proc.ChildGroup())


class DeathCheck:
    """Runs this node's HealthCheckProgram after a rank here died (bounded, see above)."""

    def __init__(self, cfg: Callable[[], Config], node: str, adapter: SlurmAdapter,
                 clock: Clock,
                 run: Callable[[Sequence[str], dict[str, str], float], proc.Completed] =
                 run_program,
                 aside: Callable[[Callable[[], None]], None] | None = None):
        self.cfg = cfg
        self.node = node
        self.adapter = adapter
        self.clock = clock
        self.run = run
        self.aside = aside or _on_a_thread
        self.lock = threading.Lock()
        self.busy = False
        self.last: float | None = None
        self.program: str | None = None  # HealthCheckProgram, read once it answers
        self.said_none = False
        self.runs = 0

    def rank_died(self, job_id: int, ranks: Sequence[int]) -> bool:
        """A rank of ``job_id`` here went from running to dead: run the gate unless one ran
        within ``health.check_on_rank_death_s`` or runs now. Whether one was started."""
        every_s = self.cfg().health.check_on_rank_death_s
        if every_s <= 0:
            return False
        now = self.clock.monotonic()
        with self.lock:
            if self.busy or (self.last is not None and now - self.last < every_s):
                return False
            self.busy, self.last = True, now
        self.aside(lambda: self._check(job_id, tuple(ranks)))
        return True

    def _check(self, job_id: int, ranks: tuple[int, ...]) -> None:
        try:
            program = self._program()
            if program is None:
                return
            cfg = self.cfg()
            # The hook sees why it runs: it drains on what it finds, and leaves the periodic
            # runs' bookkeeping (the pass streak that resumes a drained node) alone.
            env = {"SLURMD_NODENAME": self.node, "PATH": PLAIN_PATH, ENV_AFTER_RANK_DEATH: "1"}
            log.info("a job's rank died here: running the node's HealthCheckProgram now",
                     job_id=job_id, ranks=list(ranks)[:16], program=program)
            try:
                done = self.run([program], env, cfg.hooks.healthcheck_timeout_s + GRACE_S)
            except proc.CommandError as exc:
                log.error("couldn't run HealthCheckProgram after a rank died; the node is "
                          "checked at Slurm's next HealthCheckInterval", job_id=job_id,
                          program=program, error=str(exc))
                return
            self.runs += 1
            # Our gate drains a faulty node itself and exits 0 (as under slurmd); what it
            # found is in its own lines. Non-zero: a site program failed, or the gate could
            # not drain (slurmd would then drain the node with its own reason; here nothing).
            if done.returncode == 0:
                log.info("HealthCheckProgram finished after a rank died", job_id=job_id,
                         rc=0, seconds=round(done.seconds, 3))
            else:
                log.warning("HealthCheckProgram exited non-zero after a rank died",
                            job_id=job_id, rc=done.returncode, seconds=round(done.seconds, 3),
                            stderr=(done.stderr or "").strip()[-400:])
        finally:
            with self.lock:
                self.busy = False

    def _program(self) -> str | None:
        """Slurm's HealthCheckProgram (read once), or None, said once."""
        if self.program is not None:
            return self.program
        try:
            # parse_show_config reads Slurm's "(null)" as "".
            value = self.adapter.show_config().get("HealthCheckProgram", "")
        except SlurmError as exc:
            log.warning("couldn't read HealthCheckProgram after a rank died; asked again at "
                        "the next death", error=str(exc))
            return None
        if not os.path.isabs(value):  # unset, or a path slurmd itself would not run
            if not self.said_none:
                log.warning("no HealthCheckProgram in Slurm's configuration: a rank that died "
                            "here is not followed by a health check", value=value)
                self.said_none = True
            return None
        self.program = value
        return value


def _on_a_thread(fn: Callable[[], None]) -> None:
    """One thread at a time (``busy``), each bounded by the hook's own limit."""
    threading.Thread(target=fn, name="death-check", daemon=True).start()
