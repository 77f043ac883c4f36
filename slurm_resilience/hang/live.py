"""The ``heartbeat`` settings as the agent runs with them, re-read when the file changes
(e.g. observe → act) without a restart; a broken file keeps the previous settings."""

from __future__ import annotations

import os

from slurm_resilience import config
from slurm_resilience.config import Config
from slurm_resilience.log import get_logger

log = get_logger("heartbeat")


class LiveConfig:
    def __init__(self, cfg: Config, path: str | None = None):
        self.cfg = cfg
        self.path = path if path is not None else config.resolve_path()[0]
        self.mtime = self._mtime()

    def _mtime(self) -> float:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return 0.0

    def reload(self) -> bool:
        """Re-read the file when it changed; True when the heartbeat section changed."""
        mtime = self._mtime()
        if mtime == self.mtime:
            return False
        self.mtime = mtime
        try:
            fresh = config.load(self.path)
        except config.ConfigError as exc:
            log.error("heartbeat: reload: couldn't reload config; keeping the previous "
                      "heartbeat settings", error=str(exc))
            return False
        changed = fresh.heartbeat != self.cfg.heartbeat
        if changed:
            log.info("heartbeat settings reloaded", mode=fresh.heartbeat.mode)
        self.cfg = fresh
        return changed
