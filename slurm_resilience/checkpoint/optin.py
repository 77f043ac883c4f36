"""The job's explicit opt-ins: environment variables a job sets to accept a loss it would
otherwise get an error for. The training side reads and validates them (manager.py); the
agent names them in its errors (stagein.py). Kept here, free of heavy imports, for both."""

from __future__ import annotations

from collections.abc import Mapping

from slurm_resilience.checkpoint.errors import CheckpointError

ENV_ALLOW_FRESH = "SLURM_RESILIENCE_CKPT_ALLOW_FRESH_START"
ENV_ALLOW_OLDER = "SLURM_RESILIENCE_CKPT_ALLOW_OLDER_STEP"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """An opt-in flag; a value that is neither yes nor no raises (a typo must not silently
    mean 'no' for one of these, nor 'yes')."""
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CheckpointError(f"checkpoint: {name}={env[name]!r} is not a yes/no value "
                          f"(use 1 or 0)")
