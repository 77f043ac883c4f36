"""The fake InfiniBand sysfs against real ibstat/ibstatus captures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import InfinibandCheckSection
from slurm_resilience.fakes import sysfs
from slurm_resilience.health.checks import infiniband as ib
from slurm_resilience.health.collectors import infiniband as collector
from slurm_resilience.health.findings import Severity

IBSTAT = REAL_FIXTURES / "ibstat"
COUNTERS = list(InfinibandCheckSection().max_counter_delta)


def down_ports(text: str) -> list[str]:
    """``<ca> port<n>`` of every port a real ibstat capture shows not Active."""
    out, ca, port = [], "", 0
    for line in text.splitlines():
        s = line.strip()
        if line.startswith("CA '"):
            ca = line.split("'")[1]
        elif re.match(r"^Port \d+:$", s):
            port = int(s[5:-1])
        elif s.startswith("State:") and s.split(":", 1)[1].strip() != "Active":
            out.append(f"{ca} port{port}")
    return out


@pytest.mark.parametrize("capture", sorted(p.name for p in IBSTAT.glob("ibstat_*.txt")))
def test_check_on_a_tree_built_from_each_ibstat_capture(tmp_path: Path, capture: str) -> None:
    """Every port a real capture shows Down fails, every Active one passes, rails included."""
    text = (IBSTAT / capture).read_text()
    names = sysfs.build_from_ibstat(str(tmp_path), text)
    expected = tuple(names)
    if "ibpanic" in text:  # ibstat died on mlx5_8: the node should have had it
        expected += ("mlx5_8",)
    cfg = InfinibandCheckSection(expected_hcas=expected)
    findings = ib.check(collector.collect(str(tmp_path), COUNTERS), cfg, ib.IbState()).findings
    failing = sorted({f.subject for f in findings if f.severity is Severity.FAIL})
    want = sorted(down_ports(text) + (["mlx5_8"] if "ibpanic" in text else []))
    assert failing == want
    for f in findings:
        if f.severity is Severity.FAIL and "port" in f.subject:
            assert re.search(r" (DOWN|INIT) \(expected ACTIVE\)$", f.message), f.message


def test_fake_down_port_matches_what_ibstat_shows_for_a_dead_cx7(tmp_path: Path) -> None:
    """A port the fake puts down reads as ibstat shows real dead ports: Down/Disabled/40."""
    sysfs.build(str(tmp_path), 1)
    sysfs.port_down(str(tmp_path), "mlx5_0", 1)
    port = collector.collect(str(tmp_path), COUNTERS).hcas["mlx5_0"].ports["1"]
    real = (IBSTAT / "ibstat_h100-node_cx7-roce_two-ports-down-disabled.txt").read_text()
    assert "State: Down\n\t\tPhysical state: Disabled\n\t\tRate: 40" in real
    assert (port.state, port.phys_state) == ("1: DOWN", "3: Disabled")
    assert ib.rate_gbps(port.rate) == 40


def test_healthy_fake_values_are_what_ibstatus_reads_from_sysfs(tmp_path: Path) -> None:
    """ibstatus prints sysfs verbatim; the fake's strings have the same shape."""
    real = (IBSTAT / "ibstatus_a100-azure-node_mt4124-hdr200_all-active.txt").read_text()
    assert "state:           4: ACTIVE" in real and "phys state:      5: LinkUp" in real
    assert "rate:            200 Gb/sec (4X HDR)" in real
    sysfs.build(str(tmp_path), 1, rate="200 Gb/sec (4X HDR)")
    port = collector.collect(str(tmp_path), COUNTERS).hcas["mlx5_0"].ports["1"]
    assert (port.state, port.phys_state, port.rate) == (
        "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)")
