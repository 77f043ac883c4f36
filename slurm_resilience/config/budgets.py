"""Cross-checks of the hooks' time budgets: every wait a hook may do must fit in its limit.

Each hook (prolog, epilog, HealthCheckProgram) runs its steps one after another under a
watchdog set to ``hooks.<hook>_timeout_s``. The waits below are the ones a step may
spend in full on a bad day (a collector stuck in D-state, an agent that does not answer,
uploads still going); their sum must stay under the limit, so that the watchdog is a
last resort and not the normal end of a slow hook. Pure: a config in, conflicts out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_resilience.config.schema import Config

# What the NCCL prolog/epilog keeps back from the hook's limit for itself (nccl/steps.py).
NCCL_MARGIN_S = 2.0
# The epilog polls the agent every this often while uploads are pending (uploader/steps.py).
CKPT_POLL_S = 0.5
# The share of the epilog's spare time (its limit less every wait above) that removing a
# job's staging dir may take; the rest of the tree is handed to the agent (uploader/steps.py).
EPILOG_REMOVE_SHARE = 0.5
# The share of a hook's spare time that removing a job's run dir may take (hang/steps.py);
# with EPILOG_REMOVE_SHARE it leaves a quarter of the epilog's spare time unspent.
RUN_DIR_REMOVE_SHARE = 0.25
# Limit of one mount(8) or umount(8) of a job's run-dir tmpfs (heartbeat/jobfs.py).
MOUNT_TIMEOUT_S = 1.0
# Slurm calls a healthy-again HealthCheckProgram makes: its gres, then resume (show + update).
HEALTHCHECK_SLURM_CALLS = 3


@dataclass(frozen=True)
class Wait:
    """One wait a hook step may spend in full: the key that sets it, and its seconds."""

    key: str
    seconds: float


@dataclass(frozen=True)
class Conflict:
    """A hook whose waits add up to more than its limit."""

    limit_key: str
    limit_s: float
    waits: tuple[Wait, ...]

    @property
    def total_s(self) -> float:
        return sum(w.seconds for w in self.waits)

    def message(self) -> str:
        parts = " + ".join(f"{w.key}={w.seconds:g}" for w in self.waits)
        return (f"{self.limit_key}={self.limit_s:g} is shorter than the waits it must hold: "
                f"{parts} = {self.total_s:g}s; raise {self.limit_key} to at least "
                f"{self.total_s:g} or lower one of those")


def idle_diag(cfg: Config) -> bool:
    """Idle nodes run the active diagnostics under the NCCL node lock."""
    return cfg.health.diag.enabled and cfg.health.diag.idle_interval_s > 0


def hook_waits(cfg: Config) -> dict[str, tuple[Wait, ...]]:
    """The worst-case waits of each hook, by the key of its limit."""
    agent = cfg.agent.request_timeout_s
    health = Wait("health.collector_timeout_s", cfg.health.collector_timeout_s)
    prolog: list[Wait] = [health]
    epilog: list[Wait] = [health]
    if cfg.node.job_tmpfs.enabled:
        # mounting the job's run-dir tmpfs (the prolog may first unmount a leftover one)
        prolog.append(Wait("node.job_tmpfs (mount, umount)", 2 * MOUNT_TIMEOUT_S))
        epilog.append(Wait("node.job_tmpfs (umount)", MOUNT_TIMEOUT_S))
    if cfg.checkpoint.enabled:
        prolog.append(Wait("agent.request_timeout_s", agent))
        # job_end, then polling until epilog_wait_s, whose last call may take a full timeout.
        epilog += [Wait("agent.request_timeout_s (x2)", 2 * agent + CKPT_POLL_S),
                   Wait("checkpoint.epilog_wait_s", cfg.checkpoint.epilog_wait_s),
                   # handing a staging dir too big to remove in time to the agent
                   Wait("agent.request_timeout_s (hand-off)", agent)]
    if cfg.health.diag.enabled and cfg.health.diag.after_failure:
        epilog.append(Wait("health.diag.after_failure_timeout_s",
                           cfg.health.diag.after_failure_timeout_s))
    if cfg.nccl.enabled or idle_diag(cfg):
        # the hand-off from idle verification (NCCL or diagnostics)
        prolog += [Wait("nccl.handoff_timeout_s", cfg.nccl.handoff_timeout_s),
                   Wait("nccl margin", NCCL_MARGIN_S)]
    # Idle diagnostics ask once more whether the node is idle before starting.
    calls = HEALTHCHECK_SLURM_CALLS + (1 if idle_diag(cfg) else 0)
    healthcheck = (health, Wait(f"slurm.timeout_s (x{calls})", calls * cfg.slurm.timeout_s))
    return {"hooks.prolog_timeout_s": tuple(prolog), "hooks.epilog_timeout_s": tuple(epilog),
            "hooks.healthcheck_timeout_s": healthcheck}


def conflicts(cfg: Config) -> list[Conflict]:
    """Every hook whose waits do not fit in its limit (empty when all fit)."""
    h = cfg.hooks
    limits = {"hooks.prolog_timeout_s": h.prolog_timeout_s,
              "hooks.epilog_timeout_s": h.epilog_timeout_s,
              "hooks.healthcheck_timeout_s": h.healthcheck_timeout_s}
    out = []
    for key, waits in hook_waits(cfg).items():
        conflict = Conflict(key, limits[key], waits)
        if conflict.total_s > conflict.limit_s:
            out.append(conflict)
    return out


def spare_s(cfg: Config, limit_key: str) -> float:
    """What a hook's limit leaves over after every wait it must hold (0 when nothing)."""
    limits = {"hooks.prolog_timeout_s": cfg.hooks.prolog_timeout_s,
              "hooks.epilog_timeout_s": cfg.hooks.epilog_timeout_s}
    total = sum(w.seconds for w in hook_waits(cfg)[limit_key])
    return max(0.0, limits[limit_key] - total)


def epilog_remove_s(cfg: Config) -> float:
    """Seconds the epilog may spend removing a job's staging dir: a share of its spare time."""
    return spare_s(cfg, "hooks.epilog_timeout_s") * EPILOG_REMOVE_SHARE


def run_dir_remove_s(cfg: Config, limit_key: str) -> float:
    """Seconds the prolog or epilog (by its limit's key) may spend removing a job's run
    dir; what doesn't fit is set aside for the agent (hang/steps.py)."""
    return spare_s(cfg, limit_key) * RUN_DIR_REMOVE_SHARE
