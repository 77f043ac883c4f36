"""conf/grafana-dashboard.json: every query names only metrics the agent exports, and the
panels the operators asked for are there."""

from __future__ import annotations

import json
from pathlib import Path

from agent_metrics import NAME, exported

DASHBOARD = Path(__file__).resolve().parents[2] / "conf" / "grafana-dashboard.json"
def queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_every_query_names_exported_metrics(tmp_path: Path) -> None:
    names = exported(tmp_path)
    used = {(title, m) for title, expr in queries() for m in NAME.findall(expr)}
    assert used
    missing = sorted((title, m) for title, m in used if m not in names)
    assert not missing, f"queries name metrics the agent doesn't export: {missing}"
    assert all(NAME.search(expr) for _, expr in queries()), "a query names no metric of ours"


def test_the_panels_operators_asked_for_are_there() -> None:
    dash = json.loads(DASHBOARD.read_text())
    rows = {p["title"] for p in dash["panels"] if p["type"] == "row"}
    assert {"Fleet health", "Drains and returns", "Hang incidents", "Goodput",
            "Stragglers and step time", "Checkpoints"} <= rows
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_panels_name_nodes_and_cover_stragglers_staleness_nccl_and_up() -> None:
    """No legend shows a scrape address (nodes are named by joining agent_info), and the
    straggler-node, gate-staleness, NCCL-test and agents-up panels are there."""
    dash = json.loads(DASHBOARD.read_text())
    legends = [(p["title"], t["legendFormat"]) for p in dash["panels"]
               for t in p.get("targets", [])]
    assert not [x for x in legends if "{{instance}}" in x[1]], legends
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", []))
             for p in dash["panels"]}
    for title, metric in (("Straggler nodes (slower than the rest of their job)",
                           "job_straggler_node_slowdown_ratio"),
                          ("Gate staleness (since the last run)", "gate_check_last_run_timestamp"),
                          ("NCCL test passed", "nccl_test_passed"),
                          ("Agents up, by node", " up"),
                          ("Nodes in our drain, for how long", "node_our_drain_since")):
        assert metric in exprs.get(title, ""), title
        assert "group_left (node) slurm_resilience_agent_info" in exprs[title] or \
            "by (instance, job, node)" in exprs[title], title
