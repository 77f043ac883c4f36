"""Which steps each hook runs, in order. One line per capability.

A step is ``module:function`` taking a :class:`~slurm_resilience.hooks.context.HookContext`
and returning a list of :class:`~slurm_resilience.hooks.context.Problem`. Modules are
imported only when the hook runs, and a step must keep its own imports light
(no torch, no boto3 on the prolog path).
"""

from __future__ import annotations

PROLOG: list[str] = [
    "slurm_resilience.health.steps:prolog",
    "slurm_resilience.hang.steps:prolog_run_dir",
    "slurm_resilience.uploader.steps:prolog",
    "slurm_resilience.nccl.steps:prolog",
]

EPILOG: list[str] = [
    "slurm_resilience.health.steps:epilog",
    "slurm_resilience.hang.steps:epilog_run_dir",
    "slurm_resilience.uploader.steps:epilog",
    "slurm_resilience.nccl.steps:epilog",
]

HEALTHCHECK: list[str] = [
    "slurm_resilience.health.steps:healthcheck",
    "slurm_resilience.nccl.steps:healthcheck",
]
