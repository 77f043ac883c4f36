"""Services the agent starts, in order: ``module:factory`` taking an AgentContext and
returning a Service (or None when the service is disabled by config). One line each."""

from __future__ import annotations

SERVICES: list[str] = [
    "slurm_resilience.hooks.supervisor:factory",  # first: hooks are fast from the start
    "slurm_resilience.hang.watcher:factory",
    "slurm_resilience.hang.stale:factory",  # removes job run dirs set aside by hooks
    "slurm_resilience.hang.limits:factory",  # warns ranks ahead of the time limit
    "slurm_resilience.uploader.service:factory",
    "slurm_resilience.uploader.buddy_service:factory",  # after both: uses the exchange, uploader
    "slurm_resilience.stragglers.service:factory",  # reads the watcher's job views
    "slurm_resilience.goodput.service:factory",  # reads the watcher's and uploader's state
    "slurm_resilience.metrics.service:factory",  # last: it reads the others' state
]
