"""Which run of a job a heartbeat, an incident or a ledger entry belongs to.

A job is restarted two ways: Slurm requeues it (``Restarts`` counts up, the batch script
starts again) or ``slurm-resilience launch`` relaunches its step inside the same
allocation (``Restarts`` stays). Incidents are handled once per *attempt*, which tells both
apart in one integer that stays equal to ``Restarts`` for jobs that are never relaunched:

    attempt = restarts + RELAUNCH_STRIDE * relaunch

so a plain job's attempts (0, 1, 2, ...) are what they always were, and relaunch 2 of the
first run is 2000. Ranks see ``SLURM_RESILIENCE_RELAUNCH`` (the launcher sets it) and
``SLURM_RESTART_COUNT`` (Slurm sets it).
"""

from __future__ import annotations

from collections.abc import Mapping

RELAUNCH_STRIDE = 1000
MAX_RELAUNCHES = 999  # relaunches of one run (the launcher's --max-restarts is capped here)
MAX_ATTEMPT = RELAUNCH_STRIDE * (MAX_RELAUNCHES + 1) - 1
ENV_RELAUNCH = "SLURM_RESILIENCE_RELAUNCH"
# Requeues plus relaunches: what a training script compares with 0 to know it restarted.
ENV_RESTART_COUNT = "SLURM_RESILIENCE_RESTART_COUNT"
ENV_JOINED = "SLURM_RESILIENCE_JOINED"  # nodes that joined the step at this relaunch


def attempt(restarts: int, relaunch: int = 0) -> int:
    if not 0 <= restarts < RELAUNCH_STRIDE or not 0 <= relaunch <= MAX_RELAUNCHES:
        raise ValueError(f"restarts {restarts} or relaunch {relaunch} out of range")
    return restarts + RELAUNCH_STRIDE * relaunch


def restarts_of(run: int) -> int:
    """Slurm's ``Restarts`` of an attempt."""
    return run % RELAUNCH_STRIDE


def relaunch_of(run: int) -> int:
    return run // RELAUNCH_STRIDE


def _digits(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 6 else 0


def from_env(env: Mapping[str, str]) -> int:
    """This process's attempt, from Slurm's restart count and the launcher's relaunch
    count (out-of-range values count as 0: a slot's number is a hint the agent checks)."""
    restarts = _digits(env, "SLURM_RESTART_COUNT")
    relaunch = _digits(env, ENV_RELAUNCH)
    if restarts >= RELAUNCH_STRIDE or relaunch > MAX_RELAUNCHES:
        return min(restarts, RELAUNCH_STRIDE - 1)
    return attempt(restarts, relaunch)
