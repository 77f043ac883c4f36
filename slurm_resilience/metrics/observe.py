"""``slurm_resilience_observed_decisions_total``: actions observe mode decided and did not
carry out, by action (from the node's ``observed.json``, see ``slurm/observed.py``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from slurm_resilience.slurm import observed

LATEST = 10  # decisions shown by text (bounded label values), for `status --cluster`
ACTIONS = ("drain", "resume", "requeue", "hold", "cancel", "release", "exclude", "comment")


def metrics(events_path: str, mode: str) -> Iterator[Metric]:
    g = GaugeMetricFamily("slurm_resilience_observe_mode", "1 when this node's suite runs in "
                          "observe mode (decides, reports, acts on nothing)")
    g.add_metric([], 1 if mode == "observe" else 0)
    yield g
    doc = observed.read(observed.path_beside(events_path)) if events_path else observed.empty()
    c = CounterMetricFamily("slurm_resilience_observed_decisions", "distinct actions observe "
                            "mode decided and did not carry out (a repeat of the same one is "
                            "not counted again)", labels=["action"])
    for action in sorted(set(ACTIONS) | set(doc["counts"])):
        c.add_metric([action], doc["counts"].get(action, 0))
    yield c
    g = GaugeMetricFamily("slurm_resilience_observed_decision_timestamp_seconds",
                          f"Unix time of each of the latest {LATEST} decisions observe mode "
                          "did not carry out, last seen", labels=["action", "target", "detail"])
    for d in doc["decisions"][-LATEST:]:
        g.add_metric([d["action"], d["target"], d["detail"]], d["last"])
    yield g


def cluster_lines(samples: list[tuple[str, dict[str, str], float]]) -> list[str]:
    """Pure: ``would drain node7: ...`` from one agent's scraped samples."""
    rows = [(v, lb) for n, lb, v in samples
            if n == "slurm_resilience_observed_decision_timestamp_seconds"]
    return [f"would {lb.get('action', '?')} {lb.get('target', '?')}: {lb.get('detail', '')}"
            for _, lb in sorted(rows, key=lambda r: r[0])]
