"""conf/prometheus-rules.yml: promtool accepts it, every alert fires in
prometheus-rules.test.yml (promtool test rules) on the series it is about, and every rule
names only metrics the agent exports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from agent_metrics import NAME, exported

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "conf" / "prometheus-rules.yml"
RULES_TEST = Path(__file__).with_name("prometheus-rules.test.yml")
WANTED = {"SlurmResilienceAgentDown", "SlurmResilienceGateStale", "SlurmResilienceConfigInvalid",
          "SlurmResilienceNodeDrainedLong", "SlurmResilienceNcclGateFailing",
          "SlurmResilienceUploadBacklogGrowing", "SlurmResilienceJobGoodputLow",
          "SlurmResilienceHangBudgetSpent"}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make setup` installs Debian's prometheus package"
    return path


def rules() -> list[dict[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules_file() -> None:
    """`promtool check rules` accepts the shipped rules, and they are the alerts asked for."""
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {r["alert"] for r in rules()} == WANTED


def test_every_alert_fires_in_promtool_test_rules() -> None:
    """`promtool test rules` passes, and it makes every alert fire at least once."""
    out = subprocess.run([promtool(), "test", "rules", str(RULES_TEST)], capture_output=True,
                         text=True, timeout=60, cwd=RULES_TEST.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = yaml.safe_load(RULES_TEST.read_text())
    fired = {t["alertname"] for case in doc["tests"] for t in case["alert_rule_test"]
             if t.get("exp_alerts")}
    assert fired == WANTED


def test_every_rule_names_exported_metrics_and_the_node(tmp_path: Path) -> None:
    """Each rule's metrics are ones the agent exports, and each alert that is about a node
    carries its name (joined on agent_info)."""
    names = exported(tmp_path)
    for rule in rules():
        used = set(NAME.findall(rule["expr"]))
        assert used, rule["alert"]
        missing = used - names
        assert not missing, (rule["alert"], missing)
        if rule["alert"] != "SlurmResilienceJobGoodputLow":  # a job's, over its nodes
            assert re.search(r"group_left \(node\)|by \(instance, job, node\)", rule["expr"]), \
                rule["alert"]
            assert "$labels.node" in rule["annotations"]["summary"], rule["alert"]


def test_the_role_installs_the_rules_only_when_asked(tmp_path: Path) -> None:
    """With slurm_resilience_prometheus_rules_dir set, the role's prometheus_rules tasks put
    the promtool-checked rules there; unset (the default), nothing."""
    playbook = shutil.which("ansible-playbook", path=str(Path(sys.executable).parent))
    assert playbook, "ansible-playbook is missing: the dev extra installs ansible-core"
    play = tmp_path / "play.yml"
    play.write_text("- hosts: localhost\n  connection: local\n  gather_facts: false\n"
                    "  roles: [slurm_resilience]\n")
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(ROOT / "ansible" / "roles"),
           "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "PATH": os.environ["PATH"]}
    rules_dir = tmp_path / "rules"

    def run(*extra: str) -> str:
        out = subprocess.run([playbook, str(play), "--tags", "prometheus_rules", *extra],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    assert "changed=0" in run() and not rules_dir.exists()
    assert "changed=2" in run("-e", f"slurm_resilience_prometheus_rules_dir={rules_dir}")
    assert (rules_dir / "slurm-resilience.rules.yml").read_text() == RULES.read_text()
