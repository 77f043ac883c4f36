"""What a hook step sees: the job, the node, the config, and a lazy Slurm adapter."""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

from slurm_resilience.config import Config

if TYPE_CHECKING:  # the adapter loads on first use: the healthy prolog never calls Slurm
    from slurm_resilience.slurm.adapter import SlurmAdapter

HookKind = Literal["prolog", "epilog", "healthcheck"]

SPANK_PREFIX = "SPANK_SLURM_RESILIENCE_"
# The plugin's own rules (spank/slurm_resilience_spank.c, check_value), applied again by
# root. A run URI's prefix (is it the user's?) is checked further by the agent.
_MAX_VALUE = 1023
_CHOICES = {"HANG": ("on", "observe", "off"), "LEAF_PIN": ("on", "off"), "NCCL_TEST": ("1",)}


def option_refusal(name: str, value: str) -> str:
    """Why ``value`` is not one the SPANK plugin would have passed for ``name``; "" if it is."""
    if name not in (*_CHOICES, "CKPT_URI", "HANG_TIMEOUT"):
        return "not an option of the slurm-resilience plugin"
    if len(value) > _MAX_VALUE or not all("!" <= c <= "~" for c in value):
        return f"must be 1-{_MAX_VALUE} printable ASCII characters without spaces"
    if name in _CHOICES and value not in _CHOICES[name]:
        return "expected " + " or ".join(_CHOICES[name])
    if name == "CKPT_URI" and (not value.startswith("s3://") or value[5:6] in ("", "/")
                               or ".." in value):
        return "expected s3://bucket/prefix without '..'"
    if name == "HANG_TIMEOUT" and not (value.isdigit() and int(value) >= 10):
        return "expected whole seconds, at least 10"
    return ""


@dataclass(frozen=True)
class Problem:
    """Something a step found that should take the node out of service.

    ``reason`` is the drain reason without our prefix: short, actual against
    expected (``gpu3 XID 79 (GPU fell off the bus) 12:01:07``).
    """

    step: str
    reason: str
    drain: bool = True
    more: int = 0  # further findings folded into this one, counted in the drain reason


class HookNotes(TypedDict, total=False):
    """What steps leave for the runner and for later steps of the same hook run."""

    step: str  # the step running now (module:function), for the watchdog's message
    nccl_handoff_s: float  # how long the prolog waited for an NCCL test to hand over
    # The health gate's StateStore (typed as object: the gate stays off this import path).
    health_store: object
    # Why the configuration file did not load (the hook gates with the last good copy).
    config_invalid: str


# Set by the node agent when it runs HealthCheckProgram because a job's rank died on the
# node (hang/deathcheck.py); slurmd's own runs never carry it.
ENV_AFTER_RANK_DEATH = "SLURM_RESILIENCE_AFTER_RANK_DEATH"


@dataclass
class HookContext:
    """Inputs of one hook run. Everything from the job is untrusted."""

    kind: HookKind
    cfg: Config
    node: str
    env: Mapping[str, str]
    job_id: int | None = None
    uid: int | None = None
    gid: int | None = None
    user: str = ""
    # The process slurmd started for this hook: this one, or the hook that handed its work
    # to the hook server (whose worker runs elsewhere in the process tree). What the hook
    # starts must not outlive the slurmd above *that* process.
    hook_pid: int = field(default_factory=os.getpid)
    _adapter: SlurmAdapter | None = field(default=None, repr=False)
    notes: HookNotes = field(default_factory=lambda: HookNotes())
    _refused: set[str] = field(default_factory=set, repr=False)  # logged once per hook run

    @property
    def after_rank_death(self) -> bool:
        """A healthcheck the node agent ran because a job's rank died here: it drains on
        what it finds, and leaves the bookkeeping of slurmd's periodic runs alone (the
        streak of passes that resumes a drained node, idle tests, held jobs), so that runs
        a user's dying ranks ask for never bring a drained node back sooner. HealthCheck-
        Program's environment is slurmd's or the agent's, never a job's."""
        return self.kind == "healthcheck" and self.env.get(ENV_AFTER_RANK_DEATH) == "1"

    def job_option(self, name: str) -> str:
        """A per-job option of our SPANK plugin (``--hang-timeout`` → ``HANG_TIMEOUT``),
        or "" when it is not given or fails the re-check.

        slurmd passes the plugin's values as ``SPANK_SLURM_RESILIENCE_<NAME>``, but the
        plugin's check in sbatch is not a guarantee: a user's own ``SLURM_CONF`` and
        plugstack can set the same variables with any value. So root checks each value
        again here, by the plugin's rules, and a value that fails is logged and treated
        as not given (the job runs without that option).
        """
        value = self.env.get(f"{SPANK_PREFIX}{name.upper()}", "")
        if not value:
            return ""
        why = option_refusal(name.upper(), value)
        if why:
            if name.upper() not in self._refused:
                self._refused.add(name.upper())
                from slurm_resilience.log import get_logger

                get_logger("hooks").warning(
                    "job option refused; the job runs without it",
                    variable=f"{SPANK_PREFIX}{name.upper()}", value=value, why=why)
            return ""
        return value

    def job_options(self) -> dict[str, str]:
        """Every per-job option that passed the re-check, by name (the rest are logged)."""
        names = [k[len(SPANK_PREFIX):] for k in self.env if k.startswith(SPANK_PREFIX)]
        return {n: v for n in names if (v := self.job_option(n))}

    @property
    def adapter(self) -> SlurmAdapter:
        """Created on first use, so the healthy path makes no Slurm call at all."""
        if self._adapter is None:
            from slurm_resilience.slurm.adapter import from_config

            self._adapter = from_config(self.cfg)
            # Drains a hook makes are counted in this node's metrics (metrics.events).
            from slurm_resilience import events

            self._adapter.events_path = events.path_for(self.cfg.node.state_dir, self.node)
        return self._adapter

    def count_event(self, kind: str, cause: str) -> None:
        """Count an event of this node in its metrics (metrics.events), for steps of parts
        that sit below metrics (checkpoint): they say what happened, hooks count it."""
        from slurm_resilience import events

        events.count(events.path_for(self.cfg.node.state_dir, self.node), kind, cause)

    @classmethod
    def from_env(cls, kind: HookKind, cfg: Config, env: Mapping[str, str] | None = None,
                 node: str = "", hook_pid: int | None = None) -> HookContext:
        """Read the variables slurmd sets for Prolog/Epilog/HealthCheckProgram."""
        env = dict(os.environ if env is None else env)
        from slurm_resilience.config.paths import node_name

        def _int(name: str) -> int | None:
            value = env.get(name, "")
            return int(value) if value.isdigit() else None

        uid = _int("SLURM_JOB_UID")
        user = ""
        if uid is not None:
            try:
                user = pwd.getpwuid(uid).pw_name
            except KeyError:
                user = ""
        return cls(
            kind=kind,
            cfg=cfg,
            node=node or node_name(cfg.node.name, env),
            env=env,
            job_id=_int("SLURM_JOB_ID") or _int("SLURM_JOBID"),
            uid=uid,
            gid=_int("SLURM_JOB_GID"),
            user=user,
            hook_pid=os.getpid() if hook_pid is None else hook_pid,
        )
