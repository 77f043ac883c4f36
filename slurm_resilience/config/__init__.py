"""Load ``/etc/slurm-resilience/config.yaml`` (or ``--config`` / ``$SLURM_RESILIENCE_CONFIG``).

Finding the file needs only ``os``; the schema and the YAML loader are imported on first
use of :func:`load` or of their names, so a hook that the hook server runs (see
``hooks/endpoint.py``) never pays for them.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_resilience.config.loader import (
        ByteSize,
        ConfigError,
        load_text,
        setting,
        to_dict,
    )
    from slurm_resilience.config.schema import Config

DEFAULT_PATH = "/etc/slurm-resilience/config.yaml"
ENV_VAR = "SLURM_RESILIENCE_CONFIG"

_LAZY = {"ByteSize": "loader", "ConfigError": "loader", "load_text": "loader",
         "setting": "loader", "to_dict": "loader", "Config": "schema"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_PATH", "ENV_VAR", "ByteSize", "Config", "ConfigError", "job_config_path", "load",
    "load_text", "locate", "read", "resolve_path", "setting", "to_dict", "use_path",
]


# Where Slurm looks for slurm.conf when SLURM_CONF is not set (Debian's and most builds').
SLURM_DEFAULT_CONF = "/etc/slurm/slurm.conf"
BESIDE_SLURM_CONF = "slurm-resilience.yaml"

_process_path: str | None = None


def use_path(path: str | None) -> None:
    """Name the file this process was started with (the agent's ``--config``), so that
    whatever re-reads the configuration later (live reload) reads that same file."""
    global _process_path
    _process_path = path or None


def locate(explicit: str | None = None, env: Mapping[str, str] | None = None
           ) -> tuple[str, bool]:
    """The one lookup every process uses (hooks, agent, CLI, reload); returns the file
    and whether it was named (a named file must exist):

    1. ``explicit`` (``--config``), or the file this process was started with;
    2. ``$SLURM_RESILIENCE_CONFIG``;
    3. ``slurm-resilience.yaml`` beside the slurm.conf in use (``$SLURM_CONF``, else
       Slurm's default ``/etc/slurm/slurm.conf``): slurmd starts hooks with a fixed
       environment but always with ``SLURM_CONF``, so a file there needs no setting;
    4. ``/etc/slurm-resilience/config.yaml``.
    """
    env = os.environ if env is None else env
    if explicit or _process_path:
        return str(explicit or _process_path), True
    if env.get(ENV_VAR):
        return env[ENV_VAR], True
    slurm_conf = env.get("SLURM_CONF") or SLURM_DEFAULT_CONF
    beside = os.path.join(os.path.dirname(slurm_conf), BESIDE_SLURM_CONF)
    if os.path.isfile(beside):
        return beside, True
    return DEFAULT_PATH, False


def resolve_path(explicit: str | None = None) -> tuple[str, bool]:
    """:func:`locate` in this process's environment."""
    return locate(explicit)


def job_config_path(env: Mapping[str, str]) -> str | None:
    """:func:`locate` for code started by Slurm (hooks, job tasks) with ``env``; None
    means the default file."""
    path, named = locate(None, env)
    return path if named else None


def read(path: str | None = None) -> str | None:
    """The text of the configuration file in use; None when the default file is absent
    (all defaults). Raises :class:`ConfigError` for a named file that can't be read."""
    from slurm_resilience.config.loader import ConfigError

    source, named = locate(path)
    try:
        with open(source, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        if named:
            raise ConfigError(source, None, "", "file not found") from None
        return None
    except OSError as exc:
        raise ConfigError(source, None, "", f"couldn't read: {exc.strerror}") from None


def load(path: str | None = None) -> Config:
    """Load and validate the configuration; a missing default file means all defaults."""
    from slurm_resilience.config.loader import load_text
    from slurm_resilience.config.schema import Config

    source, _ = locate(path)
    text = read(path)
    return Config() if text is None else load_text(Config, text, source)
