"""``slurm_resilience_config_valid``: whether the node's configuration file loads now.

Read at scrape time (the file loaded again only when its stat changed), so a typo shows
within one scrape, whoever made it; an alert rule fires on 0. While it is 0 the hooks and
the agent gate with the last good copy (see ``config/lastgood.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from slurm_resilience import config
from slurm_resilience.config import lastgood

NAME = "slurm_resilience_config_valid"


class ConfigWatch:
    """The last load of the configuration file, redone when the file changes."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._key: tuple[int, ...] | None = None
        self._loaded: lastgood.Loaded | None = None

    def current(self) -> lastgood.Loaded:
        source, _ = config.locate(self.path)
        try:
            st = os.stat(source)
            key: tuple[int, ...] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = ()
        if self._loaded is None or key != self._key:
            self._loaded = lastgood.load(self.path)
            self._key = key
        return self._loaded

    def metrics(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(NAME, "1 when this node's configuration file loads, 0 when it "
                              "does not (the node gates with its last good copy; `slurm-"
                              "resilience status` and the agent's log name the file, line "
                              "and key)")
        g.add_metric([], 1 if self.current().valid else 0)
        yield g
