"""The agent's sweeper of ``<node.run_dir>/.stale/``: job run directories the prolog or the
epilog set aside (a leftover under a reused job id, a tree too big for the epilog's budget).

Hooks only rename into ``.stale/`` (instant); this service removes what is there in bounded
passes on a thread of its own, so neither a hook nor the agent's loop waits on a huge tree.
It looks at start and then every ``SWEEP_EVERY_S``, so nothing set aside while the agent
was down is forgotten, and no socket request is needed to hand a tree over.
"""

from __future__ import annotations

import os
import threading

from slurm_resilience import safefs
from slurm_resilience.agent.service import AgentContext, Handler
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config import Config
from slurm_resilience.hang.jobfs import STALE
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalBudget, RemovalIncomplete, remove_tree_at

log = get_logger("heartbeat.stale")

SWEEP_EVERY_S = 10.0
# One pass's bounds, like the checkpoint uploader's defaults (remove_max_entries/_s).
PASS_MAX_ENTRIES = 200_000
PASS_MAX_S = 20.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StaleSweeper:
    """The ``run-dir`` agent service."""

    name = "run-dir"
    interval_s = SWEEP_EVERY_S

    def __init__(self, cfg: Config, node: str, *, max_entries: int = PASS_MAX_ENTRIES,
                 max_s: float = PASS_MAX_S, clock: Clock = SystemClock()):
        self.root = P.run_root(cfg.node.run_dir, node)
        self.max_entries = max_entries
        self.max_s = max_s
        self.clock = clock
        self.thread: threading.Thread | None = None

    def tick(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            return
        if not self.pending():
            return
        self.thread = threading.Thread(target=self.sweep, name="run-dir-stale", daemon=True)
        self.thread.start()

    def pending(self) -> bool:
        """Whether ``.stale/`` holds anything (one listing, on the loop thread)."""
        try:
            return bool(os.listdir(os.path.join(self.root, STALE)))
        except OSError:
            return False

    def sweep(self) -> int:
        """One bounded pass; returns the entries removed. What is left waits for the next."""
        removed = 0
        started = self.clock.monotonic()
        try:
            rfd = safefs.open_dir(self.root)
        except OSError as exc:
            log.warning("run dir: couldn't open it to remove what was set aside",
                        path=self.root, error=str(exc))
            return 0
        try:
            sfd = os.open(STALE, _DIR_FLAGS, dir_fd=rfd)
        except OSError as exc:
            os.close(rfd)
            if not isinstance(exc, FileNotFoundError):
                log.warning("run dir: couldn't open .stale/", path=self.root, error=str(exc))
            return 0
        try:
            st = os.fstat(sfd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                log.error("run dir: .stale/ is not a root-only directory; not touching it",
                          path=self.root, owner=st.st_uid, mode=oct(st.st_mode & 0o7777))
                return 0
            for name in os.listdir(sfd):
                left_s = self.max_s - (self.clock.monotonic() - started)
                budget = RemovalBudget(max_entries=self.max_entries - removed,
                                       max_seconds=max(left_s, 0.0), clock=self.clock)
                removed += remove_tree_at(sfd, name, missing_ok=True, budget=budget)
        except RemovalIncomplete as exc:
            removed += exc.removed
            log.info("run dir: set-aside job dirs only partly removed; the rest goes next "
                     "pass", error=str(exc))
            return removed
        except OSError as exc:
            log.warning("run dir: couldn't remove job dirs set aside under .stale/",
                        path=self.root, error=str(exc))
            return removed
        finally:
            os.close(sfd)
            os.close(rfd)
        if removed:
            log.info("run dir: removed job dirs set aside under .stale/", entries=removed)
        return removed

    def handlers(self) -> dict[str, Handler]:
        return {}

    def close(self) -> None:
        """Nothing to wait for: a pass cut short is taken up again at the next start."""


def factory(ctx: AgentContext) -> StaleSweeper:
    return StaleSweeper(ctx.cfg, ctx.node)
