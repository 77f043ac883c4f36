"""Sandbox fault injection: names, arguments, the registry, and healing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slurm_resilience import config
from slurm_resilience.fakes import nvml
from slurm_resilience.health import gate
from slurm_resilience.health.collectors import nvme as nvme_collector
from slurm_resilience.health.collectors import nvml as collector_nvml
from slurm_resilience.sandbox import control, faults, hardware, resilience_conf
from slurm_resilience.sandbox.layout import Layout


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


def test_a_bad_hca_or_node_lists_the_valid_names(state: Path) -> None:
    """An HCA, port or node that isn't there is answered with the ones that are, as an
    operator typing 'ib-down:0:1' needs to see 'mlx5_0 (ports 1)'."""
    with pytest.raises(faults.FaultError, match=r"no 0 port 1; valid: mlx5_0 \(ports 1\), "
                                                r"mlx5_1 \(ports 1\)"):
        faults.inject(state, "node2", "ib-down:0:1")
    with pytest.raises(faults.FaultError, match=r"has no mlx5_9; valid: mlx5_0 .*mlx5_7"):
        faults.inject(state, "node1", "ib-missing:mlx5_9")
    with pytest.raises(faults.FaultError, match=r"no sandbox node 'node9'.*; valid: node1, node2"):
        faults.inject(state, "node9", "nvme-full")
    with pytest.raises(faults.FaultError, match="valid: node1, node2"):
        faults.heal(state, "node9")


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


# -- the health-parity fault classes, read by the real gate with the sandbox's config -------

@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, config.Config]:
    """One sandbox node's stand-ins and the sandbox's hooks config; the node's stand-in
    programs first on PATH, as the sandbox's healthcheck wrapper puts them."""
    layout = Layout(state_dir=tmp_path, nodes=1, leaves=1)
    layout.etc.mkdir(parents=True)
    control.write_resilience_conf(layout, resilience_conf.sections(layout))
    hw = hardware.prepare_node_hardware(tmp_path, ["node1"])[0]
    monkeypatch.setenv("PATH", f"{hw.bin}:{os.environ.get('PATH', '')}")
    return tmp_path, config.load(str(layout.resilience_conf))


def _reason(cfg: config.Config) -> str:
    report = gate.run(cfg, "node1", "healthcheck")
    return report.verdict.reason()


def test_prepared_node_passes_every_new_check(node: tuple[Path, config.Config]) -> None:
    """A healed node is healthy to the gate, and the new checks read its stand-ins: AER
    totals, peermem, SMART, the shared path and the Fabric Manager unit all answer."""
    state, cfg = node
    report = gate.run(cfg, "node1", "healthcheck")
    assert report.verdict.healthy, report.verdict.reason()
    text = " | ".join(f.message for f in report.findings)
    assert "not supported" not in text  # pcie_aer among them would mean no AER files
    assert {"mounts", "services", "nvme"} <= {f.check for f in report.findings}
    hw = hardware.locate(state, "node1")
    assert collector_nvml.read_aer(str(hw.pci), "00000000:18:00.0") == {
        "correctable": 0, "nonfatal": 0, "fatal": 0}


# fault, times injected, the drain reason (the first blocking finding) it must give. Every
# class is judged here; tests/integration/test_health_parity_sandbox.py drains one of each
# family through the real HealthCheckProgram.
PARITY = [
    ("nvlink-errors:2", 1, "gpu2 NVLink recovery errors +1 (expected <=0)"),
    ("gpu-recovery:1", 1,
     "gpu1 NVML recovery action DRAIN_AND_RESET: reset required (expected NONE)"),
    ("sram-ecc:0", 1, "gpu0 1 SRAM uncorrectable errors (expected <=0)"),
    ("fabric-unhealthy", 1, "fabric health UNHEALTHY: degraded bandwidth (expected HEALTHY)"),
    ("hbm-degraded:3", 1, "gpu3 ECC corrected 6000000/h (expected <=10000/h; degrading "
                        "memory)"),
    ("pcie-aer:2", 1, "gpu2 PCIe AER nonfatal +1 (expected <=0)"),
    ("pcie-replay:1", 1, "gpu1 PCIe replays +100000 in 1min (expected <=8)"),
    ("gpu-persistence-off:0", 1, "gpu0 persistence mode off (expected on)"),
    ("gpu-vbios:4", 1, "gpu4 96.00.61.00.01 VBIOS differs from NVIDIA H100 80GB HBM3 peers "
                       "(expected 96.00.74.00.01)"),
    ("gpu-driver:550.127.05", 1, "driver 550.127.05 (expected 565.*)"),
    ("peermem-unloaded", 1, "nvidia_peermem not loaded (expected loaded)"),
    ("mount-unreachable", 1, "node1/shared unreachable: No such file or directory "
                             "(expected reachable)"),
    ("nvme-media-errors", 1, "nvme 7 media errors (expected <=0)"),
    ("nvme-spare-low", 1, "nvme 10% available spare (expected >=20%)"),
    ("service-failed:nvidia-fabricmanager", 1, "nvidia-fabricmanager failed (expected active)"),
    ("ib-missing:mlx5_3", 1, "7 InfiniBand HCAs (expected 8 for NVIDIA H100 80GB HBM3)"),
    ("ib-downtrained:mlx5_5:1", 1, "mlx5_5 port1 200Gb/s (expected >=400Gb/s)"),
    ("kernel-log:sxid", 1, "fatal x1 in the kernel log (tolerated 0)"),
    ("kernel-log:nvme-io-error", 1, "nvme0n1 NVMe I/O error x1 in the kernel log (tolerated 0)"),
    ("kernel-log:soft-lockup", 3, "host CPU soft lockup x3 in the kernel log (tolerated 2)"),
    ("kernel-log:hard-lockup", 1, "host CPU hard lockup x1 in the kernel log (tolerated 0)"),
    ("kernel-log:mce", 1, "host uncorrected machine check x1 in the kernel log (tolerated 0)"),
]


@pytest.mark.parametrize(("fault", "times", "reason"), PARITY, ids=[p[0] for p in PARITY])
def test_parity_fault_drains_with_measured_against_expected_and_heals(
        node: tuple[Path, config.Config], fault: str, times: int, reason: str) -> None:
    """Each fault changes the stand-in so the real gate fails the node with a reason that
    states what it measured against what it expected; heal makes it healthy again."""
    state, cfg = node
    assert _reason(cfg) == ""  # also the baseline the counter rises are judged against
    for _ in range(times):
        faults.inject(state, "node1", fault)
    got = _reason(cfg)
    assert reason in got, got
    assert "(expected " in got or "(tolerated " in got
    faults.heal(state, "node1")
    assert _reason(cfg) == ""


def test_hw_slowdown_drains_as_a_rate_over_the_window(node: tuple[Path, config.Config]) -> None:
    """gpu-throttle:GPU:hw_slowdown warns on the first runs that see it and fails on the
    throttle_fail_runs-th within throttle_window_s (the sandbox keeps the defaults)."""
    state, cfg = node
    faults.inject(state, "node1", "gpu-throttle:5:hw_slowdown")
    runs = cfg.health.gpu.throttle_fail_runs
    assert [_reason(cfg) for _ in range(runs - 1)] == [""] * (runs - 1)
    assert _reason(cfg) == (f"gpu5 HW slowdown in {runs} runs within 60min (expected <{runs}) "
                            f"[0000:AB:00.0 sn 1650124031597]")


def test_parity_faults_change_the_stand_ins_as_the_hardware_would(
        node: tuple[Path, config.Config]) -> None:
    """What each fault writes, in the real formats: sysfs AER lines, /proc/modules, nvme-cli
    JSON through the nvme stand-in, systemctl's words and exit codes, an IB rate."""
    state, _ = node
    hw = hardware.locate(state, "node1")
    faults.inject(state, "node1", "pcie-aer:2")
    nonfatal = (hw.pci / "0000:3a:00.0" / "aer_dev_nonfatal").read_text().splitlines()
    assert "CmpltTO 1" in nonfatal and nonfatal[-1] == "TOTAL_ERR_NONFATAL 1"
    assert (hw.pci / "0000:3a:00.0" / "aer_dev_correctable").read_text().endswith(
        "HeaderOF 0\nTOTAL_ERR_COR 0\n")
    modules = hw.modules.read_text()
    assert modules.startswith("nvidia_peermem 16384 0 - Live ")
    faults.inject(state, "node1", "peermem-unloaded")
    modules = hw.modules.read_text()
    assert "nvidia_peermem" not in modules
    assert "\nnvidia 54308864 162 nvidia_uvm,nvidia_modeset, Live " in modules
    faults.inject(state, "node1", "nvme-media-errors")
    out = subprocess.run(["nvme", "smart-log", "/dev/nvme0", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    log = nvme_collector.parse_smart(out)
    assert (log.media_errors, log.available_spare, log.available_spare_threshold,
            log.critical_warning) == (7, 100, 5, 0)
    faults.inject(state, "node1", "service-failed:nvidia-fabricmanager")
    asked = subprocess.run(["systemctl", "is-active", "--", "nvidia-fabricmanager",
                            "nvidia-persistenced"], capture_output=True, text=True)
    assert (asked.stdout, asked.returncode) == ("failed\nactive\n", 3)
    unknown_unit = subprocess.run(["systemctl", "is-active", "nvidia-imex"],
                                  capture_output=True, text=True)
    assert (unknown_unit.stdout, unknown_unit.returncode) == ("inactive\n", 4)
    faults.inject(state, "node1", "ib-downtrained:mlx5_5:1")
    assert (hw.sysfs / "mlx5_5/ports/1/rate").read_text() == "200 Gb/sec (2X NDR)\n"
    assert (hw.sysfs / "mlx5_5/ports/1/state").read_text() == "4: ACTIVE\n"
    with pytest.raises(faults.FaultError, match="nvidia-fabricmanager, nvidia-persistenced"):
        faults.inject(state, "node1", "service-failed:nvidia-imex")
    with pytest.raises(faults.FaultError, match="driver VERSION"):
        faults.inject(state, "node1", "gpu-driver:latest")
