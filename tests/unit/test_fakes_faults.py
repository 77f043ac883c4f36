"""Sandbox fault injection: names, arguments, the registry, and healing."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_resilience.fakes import nvml
from slurm_resilience.sandbox import faults, hardware


@pytest.fixture
def state(tmp_path: Path) -> Path:
    hardware.prepare_node_hardware(tmp_path, ["node1", "node2"])
    return tmp_path


def test_prepared_node_has_8_gpus_8_hcas_empty_log_and_nvme(state: Path) -> None:
    """Each node gets 8 stand-in GPUs, mlx5_0..7 at NDR, an empty kmsg and an NVMe dir."""
    hw = hardware.locate(state, "node1")
    scen = nvml.read_scenario(str(hw.scenario))
    assert scen is not None and len(scen["gpus"]) == 8
    assert sorted(p.name for p in hw.sysfs.iterdir()) == [f"mlx5_{i}" for i in range(8)]
    assert (hw.sysfs / "mlx5_7/ports/1/rate").read_text() == "400 Gb/sec (4X NDR)\n"
    assert hw.kmsg.read_text() == "" and hw.nvme.is_dir() and hw.boot_id.read_text().strip()


def test_fault_changes_only_its_node(state: Path) -> None:
    """A fault on node1 leaves node2's stand-ins healthy."""
    assert faults.inject(state, "node1", "gpu-xid:3:79") == "node1: gpu3 Xid 79 logged and GPU lost"
    n1 = hardware.locate(state, "node1")
    n2 = hardware.locate(state, "node2")
    assert "NVRM: Xid (PCI:0000:5d:00): 79," in n1.kmsg.read_text()
    assert n2.kmsg.read_text() == ""
    scen = nvml.read_scenario(str(n2.scenario))
    assert scen is not None and not any(g["lost"] for g in scen["gpus"])


def test_bad_fault_names_and_arguments_are_explained(state: Path) -> None:
    """Unknown faults list the valid ones; bad arguments name what is expected."""
    with pytest.raises(faults.FaultError, match="valid: gpu-xid:GPU:XID"):
        faults.inject(state, "node1", "gpu-melt:1")
    with pytest.raises(faults.FaultError, match="expected gpu-xid:GPU:XID"):
        faults.inject(state, "node1", "gpu-xid:1")
    with pytest.raises(faults.FaultError, match=r"GPUs 0\.\.7, not 9"):
        faults.inject(state, "node1", "gpu-ecc:9")
    with pytest.raises(faults.FaultError, match="no mlx5_9 port 1"):
        faults.inject(state, "node1", "ib-down:mlx5_9:1")
    with pytest.raises(faults.FaultError, match="no sandbox node"):
        faults.inject(state, "node9", "nvme-full")


def test_registry_accepts_other_modules_faults(state: Path) -> None:
    """Another module can register its own fault kind and healer."""
    healed: list[str] = []
    faults.register("test-fault", "test-fault:X", lambda hw, args: f"did {args[0]}")
    faults.register_healer(lambda hw: healed.append(hw.node))
    try:
        assert faults.inject(state, "node2", "test-fault:7") == "node2: did 7"
        faults.heal(state, "node2")
        assert healed == ["node2"]
    finally:
        del faults.FAULTS["test-fault"]
        faults.HEALERS.pop()


def test_heal_restores_everything_like_a_reboot(state: Path) -> None:
    """heal clears the log, rebuilds GPUs, HCAs and NVMe, and changes the boot id."""
    hw = hardware.locate(state, "node1")
    boot = hw.boot_id.read_text()
    for fault in ("gpu-xid:1:48", "gpu-missing:2", "ib-down:mlx5_0:1", "nvme-full"):
        faults.inject(state, "node1", fault)
    faults.heal(state, "node1")
    scen = nvml.read_scenario(str(hw.scenario))
    assert scen == nvml.default_scenario(8)
    assert hw.kmsg.read_text() == "" and hw.boot_id.read_text() != boot
    assert (hw.sysfs / "mlx5_0/ports/1/state").read_text() == "4: ACTIVE\n"
    assert list(hw.nvme.iterdir()) == []
