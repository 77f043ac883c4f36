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
    _adapter: SlurmAdapter | None = field(default=None, repr=False)
    notes: HookNotes = field(default_factory=lambda: HookNotes())

    def job_option(self, name: str) -> str:
        """A per-job option from our SPANK plugin (``--hang-timeout`` → ``HANG_TIMEOUT``).

        slurmd gives the prolog/epilog the plugin's values as
        ``SPANK_SLURM_RESILIENCE_<NAME>``; the job's own environment is never visible
        here, which is what we want: root code reads only what the plugin validated.
        """
        return self.env.get(f"SPANK_SLURM_RESILIENCE_{name.upper()}", "")

    def job_options(self) -> dict[str, str]:
        """Every per-job option the SPANK plugin passed, by name."""
        prefix = "SPANK_SLURM_RESILIENCE_"
        return {k[len(prefix):]: v for k, v in self.env.items() if k.startswith(prefix)}

    @property
    def adapter(self) -> SlurmAdapter:
        """Created on first use, so the healthy path makes no Slurm call at all."""
        if self._adapter is None:
            from slurm_resilience.slurm.adapter import from_config

            self._adapter = from_config(self.cfg)
            # Drains a hook makes are counted in this node's metrics (metrics.events).
            from slurm_resilience.metrics import events

            self._adapter.events_path = events.path_for(self.cfg.node.state_dir, self.node)
        return self._adapter

    @classmethod
    def from_env(cls, kind: HookKind, cfg: Config, env: Mapping[str, str] | None = None,
                 node: str = "") -> HookContext:
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
        )
