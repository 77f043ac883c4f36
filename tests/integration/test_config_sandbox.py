"""A configuration typo in the real sandbox: the gate keeps working with the last good copy,
and the broken file shows in the node's metrics and in ``status``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from slurm_resilience.config import lastgood
from slurm_resilience.sandbox import control, faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def value(text: str, name: str) -> float | None:
    return next((float(s.value) for fam in text_string_to_metric_families(text)
                 for s in fam.samples if s.name == name), None)


def write_config(box: Sandbox, text: str) -> None:
    """Replace the hooks' file as an admin's editor would, valid or not."""
    conf = box.layout.resilience_conf
    tmp = conf.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, conf)


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    """The session sandbox; stand-in hardware healed afterwards (its reset restores the
    config file)."""
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def test_a_config_typo_leaves_the_gate_on_and_shows_in_metrics_and_status(box: Sandbox
                                                                          ) -> None:
    """With an unknown key in the config file, an Xid injected on node2 still drains it by
    the health check, slurm_resilience_config_valid reads 0 on node2's agent and `status`
    leads with the file, line and key that broke."""
    conf = box.layout.resilience_conf
    url = box.layout.metrics_url(box.nodes.index("node2") + 1)
    assert value(scrape(url), "slurm_resilience_config_valid") == 1
    copy = lastgood.copy_path(str(conf), lastgood.NODE_STORE_DIR)  # where the daemons keep it
    assert os.path.exists(copy), "the agent saved no last good copy"
    good = conf.read_text()
    write_config(box, good + "helth:\n  resume_after_passes: 1\n")
    line = len(good.splitlines()) + 1

    print(faults.inject(box.state_dir, "node2", "gpu-xid:3:79"))
    ctl = box.adapter()
    deadline = time.monotonic() + 60
    while not (info := ctl.show_node("node2")).drained or "XID 79" not in info.reason:
        assert time.monotonic() < deadline, f"node2 not drained: {info.state} {info.reason!r}"
        time.sleep(0.5)
    print(f"node2 drained under a broken config: {info.reason}")
    assert info.reason.startswith("SR: health: gpu3 XID 79")

    assert value(scrape(url), "slurm_resilience_config_valid") == 0
    out = subprocess.run([sys.executable, "-m", "slurm_resilience", "status", "--node",
                          "node2"], capture_output=True, text=True, timeout=120,
                         env=control.user_env(box.layout))
    first = out.stdout.splitlines()[0]
    print(first)
    assert out.returncode == 1
    assert first.startswith(f"config: INVALID: config: {conf}:{line}: helth: unknown key "
                            "(did you mean 'health'?)")
    assert f"gating with {copy}" in first


def doctor(box: Sandbox, node: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_resilience", "doctor", "--node", node],
                          capture_output=True, text=True, timeout=120,
                          env=control.user_env(box.layout))


def test_doctor_passes_a_sandbox_node_and_names_a_node_without_an_agent(box: Sandbox
                                                                         ) -> None:
    """doctor finds nothing wrong with node2 (running slurm.conf through its wrapper,
    plugstack, munge on the sandbox's socket, agent, hook server), and names the missing
    agent and hook server, with their fixes, for a node name none serves."""
    ok = doctor(box, "node2")
    print(ok.stdout, ok.stderr)
    assert ok.returncode == 0 and "no problems found" in ok.stdout
    bad = doctor(box, "node9")
    print(bad.stdout)
    assert bad.returncode == 1
    assert "  agent: the node agent does not answer" in bad.stdout
    assert "  hook_server: no hook server answers" in bad.stdout
    assert "fix: `systemctl enable --now slurm-resilience-agent`" in bad.stdout


def test_observe_mode_drains_nothing_and_says_what_it_would_have_drained(box: Sandbox
                                                                          ) -> None:
    """With `mode: observe`, an Xid on node3 leaves it in service; `status` on node3 and
    `status --cluster` say "would drain node3: SR: health: gpu3 XID 79 ..."."""
    write_config(box, yaml.safe_dump({"mode": "observe", **box.base_resilience_sections()},
                                     sort_keys=False))
    print(faults.inject(box.state_dir, "node3", "gpu-xid:3:79"))
    want = "would drain node3: SR: health: gpu3 XID 79 (GPU fell off the bus)"
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run([sys.executable, "-m", "slurm_resilience", "status", "--node",
                              "node3"], capture_output=True, text=True, timeout=120,
                             env=control.user_env(box.layout)).stdout
        if want in out:
            break
        assert time.monotonic() < deadline, f"status never said {want!r}:\n{out}"
        time.sleep(1)
    print(out)
    assert "mode observe: acting on nothing" in out
    node3 = box.adapter().show_node("node3")
    assert not node3.drained, f"observe mode drained node3: {node3.reason}"
    view = subprocess.run([sys.executable, "-m", "slurm_resilience", "status", "--cluster"],
                          capture_output=True, text=True, timeout=120,
                          env=control.user_env(box.layout)).stdout
    print(view)
    assert f"  node3: {want}" in view
