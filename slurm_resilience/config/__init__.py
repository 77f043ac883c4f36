"""Load ``/etc/slurm-resilience/config.yaml`` (or ``--config`` / ``$SLURM_RESILIENCE_CONFIG``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from slurm_resilience.config.loader import ByteSize, ConfigError, load_text, setting, to_dict
from slurm_resilience.config.schema import DEFAULT_PATH, ENV_VAR, Config

__all__ = [
    "DEFAULT_PATH", "ENV_VAR", "ByteSize", "Config", "ConfigError", "job_config_path", "load",
    "load_text", "resolve_path", "setting", "to_dict",
]


def resolve_path(explicit: str | None = None) -> tuple[str, bool]:
    """The file to read and whether the user named it (a named file must exist)."""
    if explicit:
        return explicit, True
    env = os.environ.get(ENV_VAR)
    if env:
        return env, True
    return DEFAULT_PATH, False


def job_config_path(env: Mapping[str, str]) -> str | None:
    """The file for code started by Slurm (hooks, job tasks): ``$SLURM_RESILIENCE_CONFIG``,
    then ``slurm-resilience.yaml`` beside the ``slurm.conf`` in use; None means the default.

    slurmd starts hooks with a fixed environment, but always with ``SLURM_CONF``, so a
    file beside it is found without any setting (the sandbox relies on this).
    """
    if env.get(ENV_VAR):
        return env[ENV_VAR]
    slurm_conf = env.get("SLURM_CONF", "")
    if slurm_conf:
        beside = os.path.join(os.path.dirname(slurm_conf), "slurm-resilience.yaml")
        if os.path.isfile(beside):
            return beside
    return None


def load(path: str | None = None) -> Config:
    """Load and validate the configuration; a missing default file means all defaults."""
    source, named = resolve_path(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        if named:
            raise ConfigError(source, None, "", "file not found") from None
        return Config()
    except OSError as exc:
        raise ConfigError(source, None, "", f"couldn't read: {exc.strerror}") from None
    return load_text(Config, text, source)
