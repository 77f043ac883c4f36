"""InfiniBand collector on a real sysfs capture, and the check's rails, state, rate, counters."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from conftest import REAL_FIXTURES

from slurm_resilience.config.health import InfinibandCheckSection
from slurm_resilience.fakes import sysfs
from slurm_resilience.health.checks import infiniband as ib
from slurm_resilience.health.collectors import infiniband as collector
from slurm_resilience.health.findings import Severity

REAL_TREE = REAL_FIXTURES / "infiniband-sysfs" / "gpud_h100-node_sys-class-infiniband"
COUNTERS = list(InfinibandCheckSection().max_counter_delta)
HCAS = tuple(f"mlx5_{i}" for i in range(8))


def run(snap: collector.IbSnapshot, cfg: InfinibandCheckSection | None = None,
        state: dict[str, Any] | None = None) -> tuple[list[Any], dict[str, Any]]:
    r = ib.check(snap, cfg or InfinibandCheckSection(), state or ib.IbState())
    return r.findings, r.state


def fails(findings: list[Any]) -> list[str]:
    return [f.message for f in findings if f.severity is Severity.FAIL]


def test_real_h100_capture_is_read_and_passes() -> None:
    """The real H100 sysfs capture reads as 8 NDR InfiniBand rails plus an Ethernet bond."""
    snap = collector.collect(str(REAL_TREE), COUNTERS)
    hcas = snap.hcas
    assert hcas["mlx5_0"].hca_type == "MT4129"
    assert hcas["mlx5_0"].ports["1"].state == "4: ACTIVE"
    assert hcas["mlx5_0"].ports["1"].rate == "400 Gb/sec (4X NDR)"
    assert hcas["mlx5_bond_0"].ports["1"].link_layer == "Ethernet"
    assert hcas["mlx5_1"].ports["1"].counters["link_downed"] == 255
    assert collector.IbSnapshot.from_json(snap.to_json()) == snap
    findings, state = run(snap, InfinibandCheckSection(min_rate_gbps=400))
    assert not fails(findings)
    checked = sorted({f.subject.split()[0] for f in findings})
    assert "mlx5_bond_0" not in checked and len(checked) == 8
    warned = [f.message for f in findings if f.severity is Severity.WARN]
    # Real counters sit at their maximum: link_downed (8 bits) on mlx5_1 and the 4-bit
    # excessive_buffer_overrun_errors on every HCA; a rise would be invisible, so we say so.
    assert "mlx5_1 port1 link_downed saturated at 255: further errors are invisible " \
           "(clear it with perfquery -R)" in warned
    assert sum("excessive_buffer_overrun_errors saturated at 15" in m for m in warned) == 8
    assert state.counters["mlx5_1/1"]["link_downed"] == 255


def test_fake_tree_matches_the_real_layout(tmp_path: Path) -> None:
    """The fake HCA has the real capture's files and value formats."""
    sysfs.add_hca(str(tmp_path), "mlx5_0")
    real_port = REAL_TREE / "mlx5_0" / "ports" / "1"
    fake_port = tmp_path / "mlx5_0" / "ports" / "1"
    assert sorted(p.name for p in (real_port / "counters").iterdir()) == \
        sorted(p.name for p in (fake_port / "counters").iterdir())
    for name in ("state", "phys_state", "rate", "link_layer"):
        assert (fake_port / name).read_text().strip() == (real_port / name).read_text().strip()
    for name in ("hca_type", "fw_ver", "board_id"):
        assert (tmp_path / "mlx5_0" / name).read_text().strip() == \
            (REAL_TREE / "mlx5_0" / name).read_text().strip()
    ours = collector.collect(str(tmp_path), COUNTERS).hcas["mlx5_0"].ports["1"]
    real = collector.collect(str(REAL_TREE), COUNTERS).hcas["mlx5_0"].ports["1"]
    assert ours == dataclasses.replace(real, counters=dict.fromkeys(sorted(COUNTERS), 0))


def test_port_down_fails_with_expected_state_and_rate(tmp_path: Path) -> None:
    """A DOWN port fails as ``mlx5_2 port1 DOWN (expected ACTIVE 400Gb/s)``."""
    sysfs.build(str(tmp_path))
    sysfs.port_down(str(tmp_path), "mlx5_2", 1)
    cfg = InfinibandCheckSection(expected_hcas=HCAS, min_rate_gbps=400)
    assert fails(run(collector.collect(str(tmp_path), COUNTERS), cfg)[0]) == [
        "mlx5_2 port1 DOWN (expected ACTIVE 400Gb/s)"]


def test_phys_state_not_linkup_fails(tmp_path: Path) -> None:
    """ACTIVE with phys_state other than LinkUp fails."""
    sysfs.build(str(tmp_path), 1)
    sysfs.set_port(str(tmp_path), "mlx5_0", 1, state="ACTIVE", phys_state="LinkErrorRecovery")
    assert fails(run(collector.collect(str(tmp_path), COUNTERS))[0]) == [
        "mlx5_0 port1 phys LinkErrorRecovery (expected LinkUp)"]


def test_missing_hca_or_port_fails(tmp_path: Path) -> None:
    """Every expected rail must be there: a missing HCA or port fails."""
    sysfs.build(str(tmp_path))
    shutil.rmtree(tmp_path / "mlx5_7")
    cfg = InfinibandCheckSection(expected_hcas=HCAS, ports=(1, 2))
    msgs = fails(run(collector.collect(str(tmp_path), COUNTERS), cfg)[0])
    assert "mlx5_7 missing (expected present)" in msgs
    assert "mlx5_0 port2 missing (expected present)" in msgs
    assert fails(run(collector.collect(str(tmp_path / "absent"), COUNTERS), cfg)[0])


def test_rate_below_expected_fails(tmp_path: Path) -> None:
    """An HDR (200) port where NDR (400) is expected fails."""
    sysfs.build(str(tmp_path), 2)
    sysfs.set_port(str(tmp_path), "mlx5_1", 1, state="ACTIVE", phys_state="LinkUp",
                   rate="200 Gb/sec (4X HDR)")
    cfg = InfinibandCheckSection(min_rate_gbps=400)
    assert fails(run(collector.collect(str(tmp_path), COUNTERS), cfg)[0]) == [
        "mlx5_1 port1 200Gb/s (expected >=400Gb/s)"]


def test_error_counter_rise_between_runs_fails(tmp_path: Path) -> None:
    """symbol_error rising past its threshold since the last run fails; a reset is a baseline."""
    root = str(tmp_path)
    sysfs.build(root, 1)
    _, state = run(collector.collect(root, COUNTERS))
    sysfs.add_to_counter(root, "mlx5_0", 1, "symbol_error", 50)
    findings, state = run(collector.collect(root, COUNTERS), state=state)
    assert not fails(findings)
    sysfs.add_to_counter(root, "mlx5_0", 1, "symbol_error", 1000)
    findings, state = run(collector.collect(root, COUNTERS), state=state)
    assert fails(findings) == ["mlx5_0 port1 symbol_error +1000 (expected <=100)"]
    findings, state = run(collector.collect(root, COUNTERS), state=state)
    assert not fails(findings)


def test_link_flaps_are_counted(tmp_path: Path) -> None:
    """A rise of link_downed is reported as link flaps."""
    root = str(tmp_path)
    sysfs.build(root, 1)
    _, state = run(collector.collect(root, COUNTERS))
    sysfs.add_to_counter(root, "mlx5_0", 1, "link_downed", 2)
    assert fails(run(collector.collect(root, COUNTERS), state=state)[0]) == [
        "mlx5_0 port1 link flapped 2x (link_downed +2, expected <=0)"]


def test_a_down_port_is_not_also_reported_as_a_flap(tmp_path: Path) -> None:
    """While a port is DOWN its link_downed tick is part of that finding, not a flap."""
    root = str(tmp_path)
    sysfs.build(root, 1)
    _, state = run(collector.collect(root, COUNTERS))
    sysfs.port_down(root, "mlx5_0", 1)
    sysfs.add_to_counter(root, "mlx5_0", 1, "link_downed", 1)
    findings, state = run(collector.collect(root, COUNTERS), state=state)
    assert fails(findings) == ["mlx5_0 port1 DOWN (expected ACTIVE)"]
    sysfs.set_port(root, "mlx5_0", 1, state="ACTIVE", phys_state="LinkUp")
    assert not fails(run(collector.collect(root, COUNTERS), state=state)[0])


def test_gpu_model_defaults_catch_a_vanished_hca_and_a_downtrained_link(tmp_path: Path
                                                                         ) -> None:
    """With no site config, an H100 node showing 7 of 8 HCAs fails, as does an HDR link;
    an H100 PCIe board, a node without IB, or site settings don't get the defaults."""
    root = str(tmp_path)
    sysfs.build(root, 7)
    sysfs.set_port(root, "mlx5_3", 1, state="ACTIVE", phys_state="LinkUp",
                   rate="200 Gb/sec (4X HDR)")
    snap = collector.collect(root, COUNTERS)
    r = ib.check(snap, InfinibandCheckSection(), ib.IbState(), gpu_model="NVIDIA H100 80GB HBM3")
    assert fails(r.findings) == ["7 InfiniBand HCAs (expected 8 for NVIDIA H100 80GB HBM3)",
                                 "mlx5_3 port1 200Gb/s (expected >=400Gb/s)"]
    assert not fails(ib.check(snap, InfinibandCheckSection(), ib.IbState(),
                              gpu_model="NVIDIA H100 PCIe").findings)
    site = InfinibandCheckSection(expected_hcas=HCAS[:7], min_rate_gbps=100)
    assert not fails(ib.check(snap, site, ib.IbState(), gpu_model="NVIDIA H100 80GB HBM3").findings)
    empty = collector.collect(str(tmp_path / "none"), COUNTERS)
    assert not fails(ib.check(empty, InfinibandCheckSection(), ib.IbState(),
                              gpu_model="NVIDIA H100 80GB HBM3").findings)
